"""Helpers shared by tests and benchmarks: a tiny random-weight GGUF writer and the
resolution of the ``llama-server`` binary to run against.

Nothing here is used by the server at run time.
"""
