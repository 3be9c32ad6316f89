"""What llama-server speaks: the request to make (:class:`Upstream`), its stream lines, its
errors, and the parameters for structured output, thinking and log-probabilities.

Pure (no I/O). Upstream facts this relies on (recorded from a real llama-server, see
``tests/api/protocols/recorded_llama.py``):

* Streams are SSE ``data: {...}`` lines separated by blank lines; ``/v1/chat/completions`` ends
  with ``data: [DONE]``, ``/completion`` just closes. A keep-alive ping is a ``:`` comment. An
  error after the first event arrives as ``data: {"error": {"code", "message", "type"}}``; an
  error before it is an ordinary non-200 response.
* ``/completion``'s last event has ``"stop": true``, ``stop_type`` (``"eos"``, ``"word"``,
  ``"limit"``), ``tokens_evaluated`` (the whole prompt) and ``timings``.
* ``/v1/chat/completions``'s chunk with a non-null ``finish_reason`` (``"stop"``, ``"length"``,
  ``"tool_calls"``) has an empty delta; with ``stream_options.include_usage`` one more chunk with
  ``choices: []`` carries ``usage``; the last chunk carries ``timings``.
* ``timings``: ``cache_n``, ``prompt_n`` (prompt tokens evaluated now, cache excluded),
  ``prompt_ms``, ``predicted_n``, ``predicted_ms`` (and per-token/per-second figures).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trioshed.api.protocols.options import field as field_of
from trioshed.core.grammar import grammar_safe_schema
from trioshed.errors import BadRequest, UpstreamError


@dataclass(frozen=True)
class Upstream:
    """The llama-server request for one Ollama request: ``POST path`` with JSON ``body``.

    ``runner_options`` are the request's runner overrides (``num_ctx``...) from
    :func:`split_options`, for the scheduler; they are not part of the body.
    """

    path: str
    body: dict[str, Any]
    runner_options: dict[str, Any] = field(default_factory=dict)
    #: The content of a final assistant message that llama-server continues; it echoes that
    #: text at the start of its stream, and ``OllamaStream(prefill=...)`` strips it again.
    prefill: str = ""

    def with_defaults(self, sampling: Mapping[str, Any]) -> Upstream:
        """This request with ``sampling`` parameters (a model's defaults) under the request's own."""
        return replace(self, body={**sampling, **self.body})



def format_params(fmt: object, *, chat: bool) -> dict[str, Any]:
    """llama-server parameters for Ollama's ``format`` (``"json"`` or a JSON schema)."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        schema: dict[str, Any] = {"type": "object"}
    elif isinstance(fmt, Mapping):
        schema = dict(grammar_safe_schema(fmt))  # bounds a grammar cannot hold are not enforced
    else:
        raise BadRequest(f'"format" must be "json" or a JSON schema object, got {json.dumps(fmt)}')
    if chat:
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    return {"json_schema": schema}


def think_params(think: object) -> dict[str, Any]:
    """llama-server parameters for Ollama's ``think`` (a bool, or a level such as ``"high"``)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if isinstance(think, str) and think in {"low", "medium", "high"}:
        return {"reasoning_effort": think}
    raise BadRequest(
        f'"think" must be true, false, "low", "medium" or "high", got {json.dumps(think)}'
    )


def thinking_requested(think: object) -> bool:
    """Whether Ollama's ``think`` (or OpenAI's ``reasoning_effort``) asks for thinking: ``true``
    or a level (``"low"``, ...); ``false``, ``null`` and ``"none"`` do not."""
    if isinstance(think, bool):
        return think
    return isinstance(think, str) and think not in ("", "none")


def logprob_params(req: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    logprobs = field_of(req, "logprobs", bool, "true or false")
    top = field_of(req, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= 20:
        raise BadRequest(f'"top_logprobs" must be between 0 and 20, got {top}')
    if not logprobs:
        if top:
            raise BadRequest('"top_logprobs" requires "logprobs": true')
        return {}
    # llama-server reports no logprobs at all when asked for 0 alternatives: ask for at least 1
    if chat:
        return {"logprobs": True, "top_logprobs": max(top or 0, 1)}
    return {"n_probs": max(top or 0, 1), "post_sampling_probs": False}



def has_part(messages: object, kind: str) -> bool:
    """Whether any message's content, a list of parts (OpenAI's and Anthropic's shape), holds a
    part of type ``kind`` (``image_url``, ``image``)."""
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == kind for p in content):
            return True
    return False


def strip_echo(echo: str, content: str) -> tuple[str, str]:
    """``content`` less llama-server's echo of a continued (prefilled) assistant message, and
    what is left of ``echo`` to strip from later pieces.

    Continuing a final assistant message, llama-server's first content delta repeats that
    message (``"1, 2, 3,"`` continued gives ``"1, 2, 3, "``, ``"4"``, ...); Ollama and Anthropic
    send only the new text. Stripping stops at the first piece that does not match.
    """
    if not echo or not content:
        return content, echo
    if content.startswith(echo):
        return content[len(echo) :], ""
    if echo.startswith(content):
        return "", echo[len(content) :]
    return content, ""


def parse_sse_line(line: bytes | str) -> dict[str, Any] | None:
    """One line of a llama-server stream as a JSON object, or ``None`` for nothing to translate.

    ``data: {...}`` gives the object; ``data: [DONE]``, blank lines, ``:`` comments (llama-
    server's keep-alive pings) and other SSE fields (``event:``, ``id:``) give ``None``. A bare
    JSON line (NDJSON) is accepted too. Trailing ``\\r``/``\\n`` are ignored. Malformed JSON
    raises :class:`UpstreamError`. (llama-server never splits an event over several ``data:``
    lines, so lines are read one at a time.)
    """
    if isinstance(line, bytes | bytearray):
        if line.startswith(b"data: {"):  # llama-server's events: parse the bytes as they are
            return _event(bytes(line[6:]))
        line = bytes(line).decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    if line.startswith("data:"):
        payload = line[5:].removeprefix(" ")
    elif line.startswith("error:"):  # older llama-server builds
        payload = '{"error": ' + line[6:].strip() + "}"
    elif line.lstrip().startswith("{"):
        payload = line
    else:
        return None
    if payload.strip() == "[DONE]":
        return None
    return _event(payload)


def _event(payload: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError:
        raise UpstreamError(
            f"llama-server sent malformed JSON in its stream: {payload[:200]!r}"
        ) from None
    if not isinstance(event, dict):
        raise UpstreamError(f"llama-server sent a non-object event: {payload[:200]!r}")
    return event


def upstream_error_message(event: Mapping[str, Any]) -> str:
    """The message of a llama-server error object (``{"error": {"message": ...}}`` or a string)."""
    error = event.get("error", event)
    if isinstance(error, Mapping):
        return str(error.get("message") or json.dumps(error))
    return str(error)

