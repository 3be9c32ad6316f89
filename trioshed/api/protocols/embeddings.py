"""Embeddings: Ollama's ``/api/embed`` and ``/api/embeddings`` as llama-server requests, and
llama-server's ``/v1/embeddings`` answers in Ollama's shape. Pure (no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trioshed.api.protocols.llama import Upstream
from trioshed.api.protocols.options import field, require_object, split_options
from trioshed.errors import BadRequest, UpstreamError

# llama-server serves /v1/embeddings only when started with --embeddings and a pooling type
# other than none (a generative GGUF such as gemma3 defaults to none: "Pooling type 'none' is
# not OAI compatible"); it answers L2-normalized vectors, or raw ones with embd_normalize -1,
# and fails an input longer than the physical batch (-ub) rather than truncating it.


def embed_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for an Ollama ``/api/embed`` body (``input``: text or texts).

    ``POST /v1/embeddings``; Ollama's ``truncate`` cannot be honoured (llama-server refuses an
    over-long input either way). Call :func:`is_load_only` first: no input is a load.
    """
    req = require_object(req)
    texts = req.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest('"input" must be a string or a list of strings')
    if not texts:
        raise BadRequest('"input" must not be empty')
    dimensions = field(req, "dimensions", int, "an integer")
    if dimensions is not None and dimensions < 1:
        raise BadRequest(f'"dimensions" must be a positive integer, got {dimensions}')
    field(req, "truncate", bool, "true or false")
    _, runner = split_options(req.get("options"))
    return Upstream("/v1/embeddings", {"input": texts, "encoding_format": "float"}, runner)


def embeddings_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for Ollama's older ``/api/embeddings`` (``prompt``; raw vector)."""
    req = require_object(req)
    prompt = field(req, "prompt", str, "a string") or ""
    _, runner = split_options(req.get("options"))
    body = {"input": [prompt], "encoding_format": "float", "embd_normalize": -1}
    return Upstream("/v1/embeddings", body, runner)


def _vectors(response: Mapping[str, Any]) -> list[list[float]]:
    """The embedding vectors of a ``/v1/embeddings`` answer, in input order."""
    data = response.get("data")
    if not isinstance(data, list) or not all(
        isinstance(d, Mapping) and isinstance(d.get("embedding"), list) for d in data
    ):
        raise UpstreamError(
            f"llama-server sent an unexpected embeddings answer: {str(response)[:200]}"
        )
    return [list(d["embedding"]) for d in sorted(data, key=lambda d: d.get("index", 0))]


def embed_response(
    response: Mapping[str, Any],
    model: str,
    *,
    dimensions: int | None = None,
    load_duration_ns: int,
    total_duration_ns: int,
) -> dict[str, Any]:
    """Ollama's ``/api/embed`` answer for llama-server's ``/v1/embeddings`` answer.

    With ``dimensions``, each vector is cut to that length and normalized again, as Ollama does.
    """
    vectors = _vectors(response)
    if dimensions:
        vectors = [_normalized(v[:dimensions]) for v in vectors]
    usage = response.get("usage")
    prompt_tokens = usage.get("prompt_tokens", 0) if isinstance(usage, Mapping) else 0
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": int(total_duration_ns),
        "load_duration": int(load_duration_ns),
        "prompt_eval_count": int(prompt_tokens),
    }


def embeddings_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's ``/api/embeddings`` answer: ``{"embedding": [...]}``."""
    vectors = _vectors(response)
    return {"embedding": vectors[0] if vectors else []}


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector
