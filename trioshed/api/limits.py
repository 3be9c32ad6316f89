"""What a request must satisfy before any handler runs, and the bounds on runner options (pure).

Runner options choose a process (``num_ctx`` sizes its KV cache, ``num_gpu`` its placement): an
absurd value would load, or evict to make room for, a runner that serves nobody. So values no
model can use are refused with 400 before the scheduler sees them; within the bounds, Ollama's
meaning holds (``num_gpu`` above the layer count offloads everything, ``num_ctx`` 1-3 becomes 4).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from trioshed.errors import BadRequest, UnsupportedMediaType

# Content types a JSON body may come with: JSON, plus what curl and fetch() send by default
# (Ollama's own docs use ``curl -d``, i.e. application/x-www-form-urlencoded) and no type at all.
JSON_CONTENT_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded", "application/octet-stream")

MAX_NUM_CTX = 1 << 24  # 16 Mi tokens: above every model's training context (Llama 4 Scout: 10 M)
MAX_NUM_GPU = 1 << 16  # layers; "999" (= all) is a common idiom, no model has 65 Ki layers
MAX_NUM_THREAD = 1 << 12
MAX_NUM_BATCH = 1 << 20

# name -> (lowest, highest) accepted
RUNNER_BOUNDS: dict[str, tuple[int, int]] = {
    "num_ctx": (1, MAX_NUM_CTX),
    "num_gpu": (-1, MAX_NUM_GPU),
    "main_gpu": (0, 1 << 10),
    "num_thread": (0, MAX_NUM_THREAD),
    # llama-server's warm-up decodes 2 tokens in one batch: num_batch 1 aborts it at start-up
    # (GGML_ASSERT n_tokens_all <= n_batch, found by fuzzing), and the model's load back-off then
    # refused everyone's requests for it
    "num_batch": (2, MAX_NUM_BATCH),
}


def check_content_type(content_type: str | None, method: str) -> None:
    """A body-carrying request must say JSON (or one of the lenient defaults) if it says anything."""
    if method not in ("POST", "PUT", "PATCH") or not content_type:
        return
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime in JSON_CONTENT_TYPES or mime.endswith("+json"):
        return
    raise UnsupportedMediaType(f"unsupported Content-Type {mime!r}: send the request body as application/json")


def check_runner_options(options: Mapping[str, Any]) -> None:
    """Raise BadRequest for a runner option outside :data:`RUNNER_BOUNDS` (types are checked
    where options are parsed)."""
    for name, (low, high) in RUNNER_BOUNDS.items():
        value = options.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
            raise BadRequest(f"option {name}={value} is out of range: use {low} to {high}")


def check_num_predict(value: object) -> None:
    """Ollama's num_predict: a count, -1 (no limit) or -2 (fill the context); nothing lower."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value < -2:
        raise BadRequest(f"option num_predict={value} is out of range: use a count, -1 (no limit) or -2 (fill the context)")


def check_body_fields(body: Mapping[str, Any]) -> None:
    """Fields every route reads the same way: ``stream`` is a boolean when present (Ollama's
    ``*bool``, OpenAI's ``boolean``); a string like "yes" would otherwise be taken as true."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f'"stream" must be true or false, got {json_type(stream)}')


def check_embedding_input(value: object) -> None:
    """OpenAI's embeddings ``input``: a string, strings, a token list, or token lists."""

    def tokens(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or tokens(value):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) or tokens(v) for v in value):
        return
    raise BadRequest('"input" must be a string, a list of strings, or a list of token ids (or of such lists)')


def json_type(value: object) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_unicode(raw: bytes, body: Mapping[str, Any]) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (``"\\ud800"``): Python reads it, but it is
    no text, and llama-server fails on it with a 500 ("_Map_base::at", found by fuzzing). Such a
    body is refused with 400. The full check runs only when an escape of that range appears."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("invalid JSON in request body: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text") from None
