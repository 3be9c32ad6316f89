"""Each protocol's error body, in one place, chosen by the route's path. Pure (no I/O).

* Ollama (``/api/...`` and everything else): ``{"error": "message"}``.
* OpenAI (``/v1/...``): ``{"error": {"message", "type", "param", "code"}}``, what the ``openai``
  client reads its message from; a stream that fails after it started ends with one such
  ``data:`` event (:func:`openai_error_event`).
* Anthropic (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"}}``.
* llama.cpp (its own routes: ``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``,
  ``/upstream/...``): ``{"error": {"code", "message", "type"}}``, as llama-server answers.
* Rerank (``/v1/rerank``, ``/rerank``, ``/v1/reranking``, ``/v2/rerank``): OpenAI's body (what
  llama.cpp's ``/rerank`` answers) plus Cohere's top-level ``message``, one body every rerank
  client reads.

A new protocol adds its shape function and its path prefix to :data:`_SHAPES` (longest prefix
first wins). The app's error handlers and the drain's 503 both answer through :func:`error_body`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from trioshed.errors import ContextTooLong, ModelNotFound, TrioshedError

#: OpenAI's error ``type`` by status, as Ollama's OpenAI layer answers (anything else: api_error).
_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip

#: Anthropic's error ``type`` by status (its API reference, "Errors"; anything else: api_error).
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip

#: llama-server's error ``type`` by status (its ``format_error_response``; anything else: server_error).
_LLAMA_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}  # fmt: skip

ErrorShape = Callable[[int, str, "str | None"], dict[str, Any]]


def ollama_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Ollama's error body."""
    return {"error": message}


def openai_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: what the ``openai`` client reads its message from."""
    param = "messages" if code == CONTEXT_LENGTH_EXCEEDED else None
    return {"error": {"message": message, "type": _OPENAI_ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}}


_WORDS = re.compile(rb"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)")


def context_error(raw: bytes) -> ContextTooLong | None:
    """llama-server's "request (N tokens) exceeds the available context size (M tokens)" answer
    (``exceed_context_size_error``, with ``n_prompt_tokens`` and ``n_ctx``) as ContextTooLong."""
    if b"exceed" not in raw:
        return None
    try:
        error = json.loads(raw).get("error")
        if isinstance(error, dict) and error.get("type") == "exceed_context_size_error":
            return ContextTooLong(int(error["n_prompt_tokens"]), int(error["n_ctx"]))
    except (ValueError, AttributeError, KeyError, TypeError):
        pass
    found = _WORDS.search(raw)
    return ContextTooLong(int(found[1]), int(found[2])) if found else None


#: OpenAI's ``code`` for a prompt longer than the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_message(path: str, exc: ContextTooLong) -> tuple[str, str | None]:
    """The words and ``code`` each protocol uses for a prompt too long for the context:
    OpenAI's ``context_length_exceeded`` ("This model's maximum context length is M tokens..."),
    Anthropic's "prompt is too long: N tokens > M maximum", Ollama's "the input length exceeds
    the context length"."""
    shape = shape_for(path)
    if shape is openai_error:
        return exc.openai_message(), CONTEXT_LENGTH_EXCEEDED
    if shape is anthropic_error:
        return exc.anthropic_message(), None
    return exc.message, None


def anthropic_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error body: what the ``anthropic`` client reads its message from."""
    return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def llama_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """llama-server's own error body (its ``code`` is the HTTP status)."""
    return {"error": {"code": status, "message": message, "type": _LLAMA_ERROR_TYPES.get(status, "server_error")}}


def rerank_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The rerank routes' error body: llama.cpp's (OpenAI's) and Cohere's ``message`` together."""
    return {**openai_error(status, message, code), "message": message}


#: (path prefix, shape), longest prefix first; paths matching none answer Ollama's shape.
_SHAPES: tuple[tuple[str, ErrorShape], ...] = (
    ("/v1/messages", anthropic_error),
    ("/v1/rerank", rerank_error),
    ("/v1/reranking", rerank_error),
    ("/v2/rerank", rerank_error),
    ("/rerank", rerank_error),
    ("/v1/", openai_error),
    ("/infill", llama_error),
    ("/tokenize", llama_error),
    ("/detokenize", llama_error),
    ("/apply-template", llama_error),
    ("/upstream/", llama_error),
)


def shape_for(path: str) -> ErrorShape:
    """The error shape of the protocol serving ``path``."""
    for prefix, shape in _SHAPES:
        if path.startswith(prefix):
            return shape
    return ollama_error


def error_body(path: str, status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The error body for an answer with ``status`` on ``path``, in that protocol's shape."""
    return shape_for(path)(status, message, code)


def message_for(path: str, exc: TrioshedError) -> str:
    """``exc``'s message in the words of ``path``'s protocol (a stream's last event)."""
    return context_message(path, exc)[0] if isinstance(exc, ContextTooLong) else exc.message


def openai_error_event(status: int, message: str) -> bytes:
    """The last SSE event of an OpenAI stream that failed after it started."""
    return b"data: " + json.dumps({"error": {"message": message, "type": "server_error", "code": status}}).encode() + b"\n\n"


def error_parts(path: str, exc: BaseException) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the answer to ``exc`` in the shape of ``path``'s protocol:
    a TrioshedError's own status and headers, else a 500 that names only the error's type
    (never the exception's text: it may hold paths or data; the log has it)."""
    if isinstance(exc, TrioshedError):
        code = "model_not_found" if isinstance(exc, ModelNotFound) else None
        status, message, headers = exc.status, exc.message, dict(exc.headers or {})
        if isinstance(exc, ContextTooLong):
            message, code = context_message(path, exc)
        if status == 413:
            headers["Connection"] = "close"  # a keep-alive client would hang otherwise
    else:
        status, headers, code = 500, {}, None
        message = f"internal error ({type(exc).__name__}) on {path[:100]}; the server log has the details"
    return status, headers, json.dumps(error_body(path, status, message, code)).encode()
