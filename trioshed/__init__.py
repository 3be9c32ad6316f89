"""trioshed: a model-scheduling server for local LLM inference, on Trio."""

from __future__ import annotations

__version__ = "0.1.0"

#: The Ollama release whose API trioshed serves, which ``GET /api/version`` answers: Ollama's
#: clients read that field as Ollama's version and gate features on it (Codex's ``--oss`` needs
#: 0.13.4 for ``/v1/responses``). 0.14.0 is the first with every route trioshed serves
#: (Anthropic's ``/v1/messages`` came with it). trioshed's own version is ``trioshed_version``.
OLLAMA_API_VERSION = "0.14.0"
