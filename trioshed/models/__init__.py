"""The model store (names → GGUF files) and GGUF metadata."""
