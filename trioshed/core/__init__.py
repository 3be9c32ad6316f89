"""Decisions without I/O: plain dataclasses in, plain dataclasses out. Nothing here imports trio."""
