"""trioshed: a model-scheduling server for local LLM inference, on Trio."""

from __future__ import annotations

__version__ = "0.1.0"
