"""The stores and model files (trioshed.models): GGUF headers, Modelfiles, models.toml, pulls."""
