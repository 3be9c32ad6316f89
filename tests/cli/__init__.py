"""The command line (trioshed.cli)."""
