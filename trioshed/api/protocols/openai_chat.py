"""OpenAI's Chat Completions and Completions, without I/O.

llama-server speaks them itself: trioshed relays its answers, naming the model as the client did
(:class:`ModelRenamer`, :func:`openai_model_rewrite`). A model without a chat template is served
on ``/v1/completions`` as a transcript and answered in chat's shape
(:func:`transcript_completion_body`, :func:`as_chat`, :func:`chunk_as_chat`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trioshed.api.protocols.llama import has_part, parse_sse_line, thinking_requested
from trioshed.api.protocols.transcript import media_prompt, transcript_media, with_turn_stop
from trioshed.core.grammar import (
    grammar_safe_response_format,
    grammar_safe_tools,
)
from trioshed.errors import BadRequest


def openai_model_rewrite(chunk: dict[str, Any], model: str) -> dict[str, Any]:
    """``chunk`` (an OpenAI-shaped llama-server response) with ``model`` set to trioshed's name.

    llama-server reports its GGUF file name (or ``--alias``); clients must see the name they
    asked for. Returns a new dict; chunks without ``model`` (errors) come back unchanged.
    """
    if "model" not in chunk:
        return chunk
    return {**chunk, "model": model}


class ModelRenamer:
    """llama-server's SSE bytes for the client, unchanged except ``"model"`` named as the client did.

    Pass-through for OpenAI routes: no event is parsed. Every llama-server chunk carries
    ``"model":"<alias>"`` (the runner is started with ``--alias`` = trioshed's model name, and
    serializes without spaces); inside a JSON string a quote is escaped, so those bytes can only be
    the field itself, and one ``bytes.replace`` per batch renames it. Only complete lines are
    passed on (a batch may end inside an event; the rest waits for the next one). Should the
    field not read as expected, the first event that names a model is parsed to learn it, and
    if that fails too every event is parsed and rewritten (correct, slower).
    """

    def __init__(self, upstream_name: str, client_name: str) -> None:
        self._needle = self._field(upstream_name)
        self._replacement = self._field(client_name)
        self._checked = upstream_name == client_name  # nothing to rename: never look
        self._slow = False
        self._client_name = client_name
        self._rest = b""

    @staticmethod
    def _field(name: str) -> bytes:
        return b'"model":' + json.dumps(name, ensure_ascii=False).encode()

    def feed(self, data: bytes) -> bytes:
        """The bytes to send now for ``data`` (complete lines only)."""
        data = self._rest + data
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        return self._rename(data[:cut]) if cut else b""

    def finish(self) -> bytes:
        """Whatever is left (a last line without its newline)."""
        rest, self._rest = self._rest, b""
        return self._rename(rest) if rest else b""

    def _rename(self, data: bytes) -> bytes:
        if not self._checked:
            self._learn(data)
        if self._slow:
            return b"".join(self._rewrite_line(line) for line in data.splitlines(keepends=True))
        if self._needle == self._replacement:
            return data
        return data.replace(self._needle, self._replacement)

    def _learn(self, data: bytes) -> None:
        for line in data.splitlines():
            if b'"model":' not in line or not line.startswith(b"data:"):
                continue
            self._checked = True
            if self._needle in line:
                return
            event = parse_sse_line(line)
            actual = event.get("model") if event else None
            if isinstance(actual, str) and self._field(actual) in line:
                self._needle = self._field(actual)
            else:
                self._slow = True
            return

    def _rewrite_line(self, line: bytes) -> bytes:
        event = parse_sse_line(line) if line.startswith(b"data:") else None
        if event is None or "model" not in event:
            return line
        return b"data: " + json.dumps(openai_model_rewrite(event, self._client_name)).encode() + b"\n"



_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls")


def with_grammar_safe_schemas(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``body`` with its tools' schemas and its ``response_format``'s cut to what llama-server's
    grammar holds (:mod:`trioshed.core.grammar`), or None when none needs it (the body goes
    upstream as sent)."""
    out: dict[str, Any] | None = None
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        safe = grammar_safe_tools(tools)
        if not all(a is b for a, b in zip(safe, tools, strict=True)):
            out = {**body, "tools": safe}
    fmt = body.get("response_format")
    if (safe_fmt := grammar_safe_response_format(fmt)) is not fmt:
        out = {**(out or body), "response_format": safe_fmt}
    return out


def transcript_completion_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat body for a model without a chat template as a ``/v1/completions`` body: the
    conversation as a plain transcript, cut at the next turn. With images or sounds the prompt
    is ``/completion``'s multimodal object instead (:func:`transcript_path`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a list of objects")
    out = with_response_format({k: v for k, v in body.items() if k not in _CHAT_ONLY})
    text, media = transcript_media(messages)
    if media and out.get("logprobs"):
        raise BadRequest("logprobs are not available for images or sounds sent to a model without a chat template")
    out |= {"prompt": media_prompt(text, media), "stop": with_turn_stop(out.get("stop"))}
    if out.get("logprobs") is True:
        # chat's logprobs: true + top_logprobs: N is completions' logprobs: N (at least 1: llama-server
        # reports nothing for 0); top_logprobs stays in the body (llama-server ignores it there) so
        # that the answer keeps only the N alternatives asked for
        top = out.get("top_logprobs")
        out["logprobs"] = max(top if isinstance(top, int) and not isinstance(top, bool) else 0, 1)
        out["top_logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    elif out.get("logprobs") is False:
        out.pop("logprobs")
    if "max_completion_tokens" in out:
        out.setdefault("max_tokens", out.pop("max_completion_tokens"))
    return out


def transcript_path(body: Mapping[str, Any]) -> str:
    """Where a transcript body (:func:`transcript_completion_body`) goes: ``/completion`` for one
    with media (``/v1/completions`` takes none; its answer is then read through
    :func:`~trioshed.api.protocols.transcript.completion_event`), else ``/v1/completions``."""
    return "/completion" if isinstance(body.get("prompt"), Mapping) else "/v1/completions"


def with_response_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` body with OpenAI's ``response_format`` as llama-server's
    ``json_schema`` (its completion endpoints ignore ``response_format``; its chat endpoint
    converts it the same way): ``json_object`` any JSON object, ``json_schema`` its ``schema``,
    ``text`` nothing."""
    out = dict(body)
    fmt = grammar_safe_response_format(out.pop("response_format", None))
    if fmt is None:
        return out
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_object":
        out["json_schema"] = fmt.get("schema") or {"type": "object"}  # type: ignore[union-attr]
    elif kind == "json_schema":
        spec = fmt.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise BadRequest('response_format.json_schema.schema must be a JSON schema object')
        out["json_schema"] = dict(schema)
    elif kind != "text":
        raise BadRequest('response_format.type must be "text", "json_object" or "json_schema"')
    return out


def chat_choice(choice: dict[str, Any], *, delta: dict[str, Any] | None = None, top_logprobs: int | None = None) -> dict[str, Any]:
    """A /v1/completions choice in chat's shape (``message``, or ``delta`` when streamed).
    ``top_logprobs``: the alternatives asked for (``None``: logprobs were not asked for)."""
    text = choice.get("text") or ""
    out: dict[str, Any] = {"index": choice.get("index", 0), "finish_reason": choice.get("finish_reason")}
    if delta is None:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["delta"] = delta | ({"content": text} if text else {})
    if top_logprobs is not None:
        out["logprobs"] = _chat_logprobs(choice.get("logprobs"), top_logprobs)
    return out


def _chat_logprobs(logprobs: object, top: int) -> dict[str, Any] | None:
    """llama-server's completion ``logprobs`` (already chat's ``{"content": [...]}``) with ``top``
    alternatives per token, as chat answers them."""
    if not isinstance(logprobs, Mapping) or not isinstance(logprobs.get("content"), list):
        return None
    content = [
        {**entry, "top_logprobs": list(entry.get("top_logprobs") or [])[:top]} if isinstance(entry, Mapping) else entry
        for entry in logprobs["content"]
    ]
    return {"content": content, "refusal": None}


def logprobs_asked(body: Mapping[str, Any]) -> int | None:
    """The alternatives a transcript body (:func:`transcript_completion_body`) asks for, or
    ``None`` when it asks for no logprobs."""
    if not isinstance(body.get("logprobs"), int) or isinstance(body.get("logprobs"), bool):
        return None
    top = body.get("top_logprobs")
    return top if isinstance(top, int) else 0


def as_chat(data: dict[str, Any], *, top_logprobs: int | None = None) -> dict[str, Any]:
    """A whole /v1/completions answer as a chat.completion."""
    if not isinstance(data.get("choices"), list):
        return data
    return data | {"object": "chat.completion", "choices": [chat_choice(c, top_logprobs=top_logprobs) for c in data["choices"]]}


class CompletionAsChat:
    """llama-server's /v1/completions stream lines as chat.completion.chunk lines (one per
    request): the first chunk's delta carries the role, every event names ``model``.

    As on the chat endpoint, ``usage`` comes in a chunk of its own after the one with the finish
    reason (``choices: []``, what the ``openai`` SDK expects last), and only when the client asked
    ``stream_options.include_usage`` (llama-server's completion stream puts it in the finish
    chunk, always).
    """

    def __init__(self, model: str, *, include_usage: bool = False, top_logprobs: int | None = None) -> None:
        self.model = model
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs
        self._first = True

    def feed_lines(self, lines: list[bytes]) -> bytes:
        out = []
        for line in lines:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                usage = None
                if isinstance(event.get("choices"), list):
                    role = {"role": "assistant"} if self._first else {}
                    event["choices"] = [chat_choice(c, delta=role, top_logprobs=self.top_logprobs) for c in event["choices"]]
                    event["object"] = "chat.completion.chunk"
                    self._first = False
                    if event["choices"]:
                        usage = event.pop("usage", None)
                event["model"] = self.model
                line = b"data: " + json.dumps(event).encode()
                if usage is not None and self.include_usage:
                    tail = {k: v for k, v in event.items() if k not in ("choices", "timings")}
                    line += b"\n\ndata: " + json.dumps({**tail, "choices": [], "usage": usage}).encode()
            out.append(line)
        return b"\n".join(out) + b"\n"


class LegacyLogprobs:
    """OpenAI's Completions ``logprobs`` fields beside llama-server's own (one per request).

    llama-server answers ``/v1/completions``' ``logprobs: N`` in chat's shape,
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; OpenAI's Completions (and
    the ``openai`` client's ``Logprobs`` type) read ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` per token) and ``text_offset`` (where each token
    starts in prompt + text). Both are given: llama-server's ``content`` unchanged, OpenAI's
    fields added. Offsets count from ``prompt_chars`` (the prompt's length, when it is text).
    """

    def __init__(self, prompt_chars: int = 0) -> None:
        self._offsets: dict[int, int] = {}
        self._start = prompt_chars

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        lp = choice.get("logprobs")
        if not isinstance(lp, Mapping) or not isinstance(lp.get("content"), list):
            return choice
        index = choice.get("index", 0)
        offset = self._offsets.get(index, self._start)
        entries = [e for e in lp["content"] if isinstance(e, Mapping)]
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(str(entry.get("token", "")))
        self._offsets[index] = offset
        legacy = {
            "tokens": [str(e.get("token", "")) for e in entries],
            "token_logprobs": [e.get("logprob") for e in entries],
            "top_logprobs": [
                {str(t.get("token", "")): t.get("logprob") for t in e.get("top_logprobs") or [] if isinstance(t, Mapping)} for e in entries
            ],
            "text_offset": offsets,
        }
        return {**choice, "logprobs": {**lp, **legacy}}

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """A whole answer or one streamed event with OpenAI's fields added to each choice."""
        choices = event.get("choices")
        if not isinstance(choices, list):
            return event
        return {**event, "choices": [self.choice(c) if isinstance(c, dict) else c for c in choices]}

    def lines(self, data: bytes) -> bytes:
        """Complete SSE lines with each ``data: {...}`` event rewritten (others unchanged)."""
        out = []
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                line = b"data: " + json.dumps(self.event(event), ensure_ascii=False, separators=(",", ":")).encode()
            out.append(line)
        return b"\n".join(out)


def completion_logprobs_asked(body: Mapping[str, Any]) -> bool:
    """Whether a Completions body asks for log-probabilities (``logprobs``: a count)."""
    value = body.get("logprobs")
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: A non-null finish reason, as llama-server serializes it: after the chunk carrying it only the
#: usage chunk, [DONE] and the close follow.
FINISHED = b'"finish_reason":"'


def chat_needs(body: Mapping[str, Any]) -> set[str]:
    """The capabilities a chat completion needs besides generating: ``tools`` for tools,
    ``thinking`` for a ``reasoning_effort`` other than ``none`` (as Ollama maps it to ``think``),
    ``vision`` for ``image_url`` content parts, ``audio`` for ``input_audio`` ones."""
    out = set()
    if isinstance(body.get("tools"), list) and body["tools"]:
        out.add("tools")
    if thinking_requested(body.get("reasoning_effort")):
        out.add("thinking")
    if has_part(body.get("messages"), "image_url"):
        out.add("vision")
    if has_part(body.get("messages"), "input_audio"):
        out.add("audio")
    return out
