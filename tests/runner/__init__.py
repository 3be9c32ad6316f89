"""The llama-server child (trioshed.runner): its life, output, memory log, provisioning."""
