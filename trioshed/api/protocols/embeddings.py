"""Embeddings: Ollama's ``/api/embed`` and ``/api/embeddings`` as llama-server requests, and
llama-server's ``/v1/embeddings`` answers in Ollama's and OpenAI's shapes. Pure (no I/O).

Inputs longer than the runner's context: llama-server refuses them ("input (N tokens) is too
large to process", a 500). Ollama's ``truncate`` (default true) cuts such an input to the
context, keeping the model's own special tokens (BOS/CLS before, EOS/SEP after:
:func:`truncated_tokens`); ``truncate: false`` and OpenAI's route (OpenAI never truncates) are a
400 naming the input's tokens and the context (:func:`too_long_message`).
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

from trioshed.api.protocols.llama import Upstream
from trioshed.api.protocols.options import field, require_object, split_options
from trioshed.core.context import tokens_upper_bound
from trioshed.errors import BadRequest, UpstreamError

# llama-server serves /v1/embeddings only when started with --embeddings and a pooling type
# other than none (a generative GGUF such as gemma3 defaults to none: "Pooling type 'none' is
# not OAI compatible"); it answers L2-normalized vectors, or raw ones with embd_normalize -1,
# and fails an input longer than the physical batch (-ub) rather than truncating it.

#: The most inputs one request may carry: OpenAI's own bound on ``input`` arrays. llama-server
#: spreads one request's inputs over its slots and answers them in input order.
MAX_INPUTS = 2048


def embed_inputs(req: Mapping[str, Any]) -> list[str]:
    """Ollama's ``input`` (a text or texts) as a list, else BadRequest."""
    texts = req.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest('"input" must be a string or a list of strings')
    if not texts:
        raise BadRequest('"input" must not be empty')
    check_count(len(texts))
    return texts


def input_need(value: object) -> int:
    """At most how many tokens the longest single input takes (``input`` or ``prompt``: a text,
    texts, token ids or lists of them): each input has a slot's context to itself, so this, not
    their sum, sizes the automatic context."""
    items = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
    longest = 0
    for item in items:
        if isinstance(item, str):
            longest = max(longest, len(item.encode("utf-8", "replace")))
        elif isinstance(item, list):
            longest = max(longest, len(item))
    return tokens_upper_bound(longest)


def check_count(n: int) -> None:
    if n > MAX_INPUTS:
        raise BadRequest(f'"input" has {n} items: at most {MAX_INPUTS} in one request; send the rest in another')


def too_long(status: int, raw: bytes) -> bool:
    """Whether llama-server refused an input for its length (over the micro-batch or the slot)."""
    return status in (400, 500) and (
        b"too large to process" in raw or b"larger than the max context size" in raw
    )


_RUNNER_LIMIT = re.compile(rb"current batch size: (\d+)|max context size \((\d+) tokens\)")


def runner_limit(raw: bytes, limit: int) -> int:
    """The input limit llama-server named in its refusal (its micro-batch or its slot's
    context, which may be smaller than asked: a model's training context), else ``limit``."""
    m = _RUNNER_LIMIT.search(raw)
    return min(limit, int(m[1] or m[2])) if m else limit


def too_long_message(index: int, tokens: int, context: int, *, openai: bool = False) -> str:
    """The 400 for input ``index`` of ``tokens`` tokens over a ``context``-token runner."""
    if openai:
        return (
            f"This model's maximum context length is {context} tokens, however you requested "
            f"{tokens} tokens (input {index}). Please reduce your input."
        )
    return (
        f"input {index} has {tokens} tokens, more than the context length of {context}: shorten it, "
        'set "truncate": true, or raise num_ctx'
    )


def truncated_tokens(full: list[int], plain: list[int], specials: list[int], limit: int) -> list[int]:
    """``full`` (a text's tokens with the model's special tokens) cut to ``limit`` tokens, the
    special tokens kept: ``plain`` is the same text without them, ``specials`` an empty text's
    (what the tokenizer adds, e.g. ``[CLS] [SEP]``). Ollama keeps BOS and EOS the same way."""
    n_text = len(plain)
    for before in range(len(specials) + 1):
        after = len(full) - before - n_text
        if after >= 0 and full[before : before + n_text] == plain:
            room = max(0, limit - before - after)
            return full[:before] + plain[:room] + full[before + n_text :]
    return full[:limit]


def embed_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for an Ollama ``/api/embed`` body (``input``: text or texts).

    ``POST /v1/embeddings``; ``truncate`` is the route's (see the module's docstring). Call
    :func:`is_load_only` first: no input is a load.
    """
    req = require_object(req)
    texts = embed_inputs(req)
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
    vectors = shortened(_vectors(response), dimensions)
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


def check_dimensions(req: Mapping[str, Any]) -> int | None:
    """``dimensions`` (Ollama's and OpenAI's): a positive integer or absent."""
    dimensions = field(req, "dimensions", int, "an integer")
    if dimensions is not None and dimensions < 1:
        raise BadRequest(f'"dimensions" must be a positive integer, got {dimensions}')
    return dimensions


def shortened(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """Each vector cut to ``dimensions`` and normalized again (Ollama's and OpenAI's meaning);
    a 400 above the model's own size. None: unchanged."""
    if not dimensions:
        return vectors
    size = len(vectors[0]) if vectors else 0
    if dimensions > size:
        raise BadRequest(f'"dimensions" {dimensions} is more than the model\'s {size}')
    return [_normalized(v[:dimensions]) for v in vectors]


def openai_request(req: Mapping[str, Any]) -> tuple[dict[str, Any], int | None, str]:
    """OpenAI's ``/v1/embeddings`` body as llama-server's (floats: trioshed shortens and encodes),
    with ``dimensions`` and ``encoding_format`` (``float`` or ``base64``)."""
    dimensions = check_dimensions(req)
    encoding = req.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest('"encoding_format" must be "float" or "base64"')
    value = req.get("input")
    if isinstance(value, list) and value and not isinstance(value[0], int):
        check_count(len(value))
    upstream = {k: v for k, v in req.items() if k not in ("dimensions", "encoding_format", "user")}
    upstream["encoding_format"] = "float"
    return upstream, dimensions, encoding


def openai_response(response: Mapping[str, Any], model: str, *, dimensions: int | None, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings answer: in input order, shortened, as floats or base64 (little-endian
    float32, what OpenAI's SDKs decode)."""
    vectors = shortened(_vectors(response), dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": base64_floats(v) if encoding == "base64" else v}
        for i, v in enumerate(vectors)
    ]
    usage = response.get("usage") if isinstance(response.get("usage"), Mapping) else {}
    return {"object": "list", "data": data, "model": model, "usage": dict(usage or {})}


def base64_floats(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector
