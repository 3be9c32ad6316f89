"""Request bodies and response parsing for the four APIs the harness speaks. No I/O.

| api | route | stream format |
| --- | --- | --- |
| ``ollama-generate`` | ``POST /api/generate`` | NDJSON, final line ``"done": true`` with ``eval_count`` |
| ``ollama-raw`` | ``POST /api/generate`` with ``"raw": true`` (no chat template) | as above |
| ``ollama-chat`` | ``POST /api/chat`` | NDJSON, as above |
| ``openai-chat`` | ``POST /v1/chat/completions`` | SSE ``data:`` lines, ``usage`` chunk, ``[DONE]`` |
| ``native`` | ``POST /completion`` (llama-server's own) | SSE, final chunk ``"stop": true`` with ``timings`` |

Every body carries ``model`` (llama.cpp's router routes on it; a single ``llama-server``
ignores it), temperature 0 and a token limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

APIS = ("ollama-generate", "ollama-raw", "ollama-chat", "openai-chat", "native")

PATHS = {
    "ollama-generate": "/api/generate",
    "ollama-raw": "/api/generate",
    "ollama-chat": "/api/chat",
    "openai-chat": "/v1/chat/completions",
    "native": "/completion",
}


def request_body(api: str, model: str, prompt: str, n_predict: int, stream: bool) -> dict[str, Any]:
    """The JSON body of one generation request."""
    body: dict[str, Any]
    if api in ("ollama-generate", "ollama-raw"):
        body = {
            "model": model,
            "prompt": prompt,
            "stream": stream,
            "options": {"num_predict": n_predict, "temperature": 0},
        }
        if api == "ollama-raw":
            body["raw"] = True
        return body
    if api == "ollama-chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
            "options": {"num_predict": n_predict, "temperature": 0},
        }
    if api == "openai-chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n_predict,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body
    if api == "native":
        return {
            "model": model,
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0,
            "stream": stream,
        }
    raise ValueError(f"unknown api {api!r}; expected one of {', '.join(APIS)}")


@dataclass(frozen=True)
class Chunk:
    """One parsed line of a streamed body.

    ``token``: the chunk carries generated output. ``final``: the stream's last meaningful
    chunk. ``tokens``: the generated-token count the server reported, when it did.
    """

    token: bool = False
    final: bool = False
    tokens: int | None = None
    error: str | None = None


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def parse_stream_line(api: str, line: bytes | str) -> Chunk | None:
    """Parse one line of a streamed body; ``None`` for blank lines, comments and non-data lines."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text:
        return None
    if api in ("openai-chat", "native"):
        if not text.startswith("data:"):
            return None
        text = text[5:].strip()
        if text == "[DONE]":
            return Chunk(final=True)
    try:
        obj = json.loads(text)
    except ValueError:
        return Chunk(error=f"unparsable chunk: {text[:80]}")
    if not isinstance(obj, dict):
        return Chunk(error=f"unexpected chunk: {text[:80]}")
    if "error" in obj:
        return Chunk(error=_error_text(obj["error"]), final=True)
    if api.startswith("ollama-"):
        if obj.get("done"):
            count = obj.get("eval_count")
            return Chunk(final=True, tokens=count if isinstance(count, int) else None)
        return Chunk(token=True)
    if api == "native":
        if obj.get("stop"):
            return Chunk(final=True, tokens=_native_tokens(obj))
        return Chunk(token=True)
    # openai-chat
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    else:
        tokens = None
    choices = obj.get("choices") or []
    token = False
    if choices:
        delta = choices[0].get("delta") or {}
        token = delta.get("content") is not None or delta.get("reasoning_content") is not None
    # the final chunk is [DONE]; the usage chunk only reports the count
    return Chunk(token=token, tokens=tokens)


def _native_tokens(obj: dict[str, Any]) -> int | None:
    timings = obj.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return int(timings["predicted_n"])
    n = obj.get("tokens_predicted")
    return n if isinstance(n, int) else None


def parse_full_body(api: str, body: bytes) -> tuple[int | None, str | None]:
    """``(tokens, error)`` from a non-streamed answer."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None, f"unparsable body: {body[:80]!r}"
    if not isinstance(obj, dict):
        return None, "unexpected body"
    if "error" in obj:
        return None, _error_text(obj["error"])
    if api.startswith("ollama-"):
        n = obj.get("eval_count")
        return (n if isinstance(n, int) else None), None
    if api == "native":
        return _native_tokens(obj), None
    usage = obj.get("usage") or {}
    n = usage.get("completion_tokens")
    return (n if isinstance(n, int) else None), None
