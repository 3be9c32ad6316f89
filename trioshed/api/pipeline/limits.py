"""What a request must satisfy before any handler runs (pure). The bounds on runner options
are the runner options' own (:data:`trioshed.core.runner_options.RUNNER_BOUNDS`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from trioshed.errors import BadRequest, UnsupportedMediaType

# Content types a JSON body may come with: JSON, plus what curl and fetch() send by default
# (Ollama's own docs use ``curl -d``, i.e. application/x-www-form-urlencoded) and no type at all.
JSON_CONTENT_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded", "application/octet-stream")

#: Routes whose body is an upload in a multipart form (OpenAI's audio transcriptions).
MULTIPART_ROUTES = frozenset({"/v1/audio/transcriptions"})


def check_content_type(content_type: str | None, method: str, path: str = "") -> None:
    """A body-carrying request must say JSON (or one of the lenient defaults) if it says
    anything; the upload routes take a multipart form."""
    if method not in ("POST", "PUT", "PATCH") or not content_type:
        return
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime in JSON_CONTENT_TYPES or mime.endswith("+json"):
        return
    if mime == "multipart/form-data" and path in MULTIPART_ROUTES:
        return
    raise UnsupportedMediaType(f"unsupported Content-Type {mime!r}: send the request body as application/json")


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
