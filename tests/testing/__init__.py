"""The test helpers themselves (trioshed.testing): tiny models, llama-server alone."""
