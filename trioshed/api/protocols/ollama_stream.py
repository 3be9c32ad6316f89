"""llama-server's streamed events as Ollama chunks: :class:`OllamaStream`. Pure (no I/O)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trioshed.api.protocols.llama import parse_sse_line, strip_echo, upstream_error_message
from trioshed.api.protocols.ollama import Kind, now_rfc3339
from trioshed.errors import UpstreamError

_DONE_REASONS = {"eos": "stop", "word": "stop", "limit": "length", "length": "length"}

#: Nearly every event of a stream carries one piece of text and nothing else. These match exactly
#: that event, whole, as llama-server writes it (``/completion``; ``/v1/chat/completions``), the
#: piece being group 1, a JSON string; any other event (logprobs, timings, reasoning, tool calls,
#: a field a later llama-server adds) goes the general way (parse, build, dump).
_STRING = rb'("[^"\\]*(?:\\.[^"\\]*)*")'
_COMPLETION_PIECE = re.compile(
    rb'data: \{"index":0,"content":' + _STRING + rb',"tokens":\[[0-9,]*\],"stop":false,"id_slot":-?[0-9]+,'
    rb'"tokens_predicted":[0-9]+,"tokens_evaluated":[0-9]+\}\r?\Z'
)
_CHAT_PIECE = re.compile(
    rb'data: \{"choices":\[\{"finish_reason":null,"index":0,"delta":\{"content":' + _STRING + rb"\}\}\],"
    rb'"created":[0-9]+,"id":"[^"\\]*","model":"[^"\\]*(?:\\.[^"\\]*)*","system_fingerprint":"[^"\\]*",'
    rb'"object":"chat\.completion\.chunk"\}\r?\Z'
)


def ndjson(obj: Mapping[str, Any]) -> bytes:
    """One Ollama chunk as an NDJSON line."""
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


class OllamaStream:
    """Stateful translator of one llama-server stream into Ollama chunks (one per request).

    Feed it each upstream event (:func:`parse_sse_line`'s objects) in order; :meth:`feed`
    returns the Ollama chunks to send now. Then :meth:`finish` gives the final ``done`` chunk,
    or, for ``stream: false``, :meth:`aggregate` the single response. The upstream kind is read
    from each event's shape, so a generate request served by ``/v1/chat/completions`` works.

    Tool calls arrive in pieces (OpenAI's streamed ``arguments`` fragments) and are sent whole,
    as Ollama does, in one chunk when upstream reports the finish reason.
    """

    def __init__(
        self,
        kind: Kind,
        model: str,
        *,
        created_at_fn: Callable[[], str] = now_rfc3339,
        prefill: str = "",
        top_logprobs: int = 0,
    ) -> None:
        if kind not in ("generate", "chat"):
            raise ValueError(f"kind must be 'generate' or 'chat', not {kind!r}")
        self.kind: Kind = kind
        self.model = model
        self._model_json = json.dumps(model, ensure_ascii=False).encode()
        self._created_at = created_at_fn
        self._stamp: str | None = None  # one created_at for the chunks of a batch
        self._text: list[str | bytes] = []  # bytes: a JSON string as llama-server wrote it
        self._thinking: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._tool_calls_sent = False
        self._logprobs: list[dict[str, Any]] = []
        self._done_reason: str | None = None
        self._timings: Mapping[str, Any] = {}
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        self._pieces = 0
        #: How many alternatives each logprob entry carries (the request's ``top_logprobs``).
        self.top_logprobs = top_logprobs
        self._echo = prefill  # what is left to strip of llama-server's echo of the prefill

    @property
    def finished(self) -> bool:
        """Whether upstream reported the end of generation (a stop type or finish reason).

        A stream that closes before this is a truncated one (the runner died or was stopped).
        """
        return self._done_reason is not None

    @property
    def text(self) -> str:
        """The content generated so far."""
        return "".join(p if isinstance(p, str) else json.loads(p) for p in self._text)

    # -- feeding ------------------------------------------------------------------------------

    def feed_lines(self, lines: Iterable[bytes | str]) -> list[dict[str, Any]]:
        """The Ollama chunks for a batch of upstream stream lines (what one socket read held).

        The chunks of one batch share their ``created_at``: they arrived together.
        """
        self._stamp = self._created_at()
        try:
            return [chunk for line in lines if (event := parse_sse_line(line)) is not None for chunk in self.feed(event)]
        finally:
            self._stamp = None

    def feed_lines_bytes(self, lines: Iterable[bytes]) -> bytes:
        """:meth:`feed_lines`, the chunks as NDJSON bytes (exactly ``b"".join(map(ndjson, ...))``).

        A plain text piece (see :data:`_COMPLETION_PIECE`) skips the JSON round trip: its text,
        a JSON string as llama-server wrote it, goes into the chunk as it is. That is the relay's
        cost per token on Ollama's routes."""
        self._stamp = self._created_at()
        try:
            out: list[bytes] = []
            head = None
            completion, chat = _COMPLETION_PIECE.match, _CHAT_PIECE.match
            for line in lines:
                if not line or line == b"\r":
                    continue  # the blank line after each event
                match = None if self._echo else (completion(line) or chat(line))
                if match is None:
                    event = parse_sse_line(line)
                    if event is not None:
                        out.extend(map(ndjson, self.feed(event)))
                    continue
                piece = match.group(1)
                if piece == b'""':
                    continue
                if head is None:
                    head = b'{"model": %s, "created_at": "%s", ' % (self._model_json, self._stamp.encode())
                self._pieces += 1
                self._text.append(piece)  # decoded when the whole text is asked for
                if self.kind == "generate":
                    out.append(head + b'"response": ' + piece + b', "done": false}\n')
                else:
                    out.append(head + b'"message": {"role": "assistant", "content": ' + piece + b'}, "done": false}\n')
            return b"".join(out)
        finally:
            self._stamp = None

    def feed(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The Ollama chunks for one upstream event (often one, possibly none).

        Raises :class:`UpstreamError` for an upstream error event.
        """
        if "error" in event:
            raise UpstreamError(f"llama-server error: {upstream_error_message(event)}")
        if "choices" in event:
            return self._feed_openai(event)
        return self._feed_completion(event)

    def _feed_completion(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        content = event.get("content") or ""
        probs = event.get("completion_probabilities") or []
        logprobs = [_logprob_from_completion(p, self.top_logprobs) for p in probs if isinstance(p, Mapping)]
        if content or logprobs:
            out.append(self._piece(content=content, logprobs=logprobs))
        if event.get("stop"):
            self._done_reason = _DONE_REASONS.get(str(event.get("stop_type")), "stop")
            self._timings = event.get("timings") or self._timings
            if isinstance(event.get("tokens_evaluated"), int):
                self._prompt_tokens = event["tokens_evaluated"]
            if isinstance(event.get("tokens_predicted"), int):
                self._completion_tokens = event["tokens_predicted"]
        return out

    def _feed_openai(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        if isinstance(event.get("timings"), Mapping):
            self._timings = event["timings"]
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
            self._completion_tokens = usage.get("completion_tokens", self._completion_tokens)
        for choice in event.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            content, self._echo = strip_echo(self._echo, delta.get("content") or choice.get("text") or "")
            thinking = delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                self._add_tool_call_delta(call)
            lp = choice.get("logprobs")
            logprobs = [
                _logprob_from_openai(p, self.top_logprobs)
                for p in ((lp.get("content") or []) if isinstance(lp, Mapping) else [])
                if isinstance(p, Mapping)
            ]
            if content or thinking or logprobs:
                out.append(self._piece(content=content, thinking=thinking, logprobs=logprobs))
            reason = choice.get("finish_reason")
            if reason is not None:
                self._done_reason = _DONE_REASONS.get(str(reason), "stop")
                if self._tool_calls and not self._tool_calls_sent:
                    out.append(self._tool_call_chunk())
        return out

    def _add_tool_call_delta(self, call: Mapping[str, Any]) -> None:
        index = call.get("index", len(self._tool_calls))
        slot = self._tool_calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def _ollama_tool_calls(self) -> list[dict[str, Any]]:
        calls = []
        for _, slot in sorted(self._tool_calls.items()):
            try:
                arguments = json.loads(slot["arguments"]) if slot["arguments"].strip() else {}
            except ValueError:
                raise UpstreamError(
                    f"the model called tool {slot['name']!r} with arguments that are not JSON: "
                    f"{slot['arguments'][:200]!r}"
                ) from None
            function: dict[str, Any] = {"name": slot["name"], "arguments": arguments}
            call: dict[str, Any] = {"function": function}
            if slot["id"]:
                call["id"] = slot["id"]
            calls.append(call)
        return calls

    def _tool_call_chunk(self) -> dict[str, Any]:
        self._tool_calls_sent = True
        chunk = self._head()
        chunk["message"] = {
            "role": "assistant",
            "content": "",
            "tool_calls": self._ollama_tool_calls(),
        }
        chunk["done"] = False
        return chunk

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": self._stamp or self._created_at()}

    def _piece(
        self, *, content: str, thinking: str = "", logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        self._pieces += 1
        self._text.append(content)
        if thinking:
            self._thinking.append(thinking)
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = content
            if thinking:
                chunk["thinking"] = thinking
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            chunk["message"] = message
        chunk["done"] = False
        if logprobs:
            self._logprobs.extend(logprobs)
            chunk["logprobs"] = logprobs
        return chunk

    # -- the end ------------------------------------------------------------------------------

    def _metrics(self, load_duration_ns: int, total_duration_ns: int) -> dict[str, Any]:
        t = self._timings
        cache_n = int(t.get("cache_n") or 0)
        prompt_n = int(t.get("prompt_n") or 0)
        prompt_count = (
            self._prompt_tokens if self._prompt_tokens is not None else prompt_n + cache_n
        )
        eval_count = t.get("predicted_n")
        if eval_count is None:
            eval_count = (
                self._completion_tokens if self._completion_tokens is not None else self._pieces
            )
        return {
            "total_duration": int(total_duration_ns),
            "load_duration": int(load_duration_ns),
            "prompt_eval_count": int(prompt_count),
            "prompt_eval_duration": round(float(t.get("prompt_ms") or 0.0) * 1_000_000),
            "eval_count": int(eval_count),
            "eval_duration": round(float(t.get("predicted_ms") or 0.0) * 1_000_000),
        }

    def so_far(self) -> dict[str, Any]:
        """Token counts of what was generated so far, for a stream the client left."""
        return {"prompt_eval_count": self._prompt_tokens or 0,
                "eval_count": self._completion_tokens if self._completion_tokens is not None else self._pieces}  # fmt: skip

    @property
    def timings(self) -> Mapping[str, Any]:
        """llama-server's last ``timings`` (``cache_n``, ``prompt_ms``, ``predicted_ms``...)."""
        return self._timings

    def finish(
        self, *, load_duration_ns: int, total_duration_ns: int, done_reason: str | None = None
    ) -> dict[str, Any]:
        """The final Ollama chunk: ``done: true``, ``done_reason`` and the metrics (ns).

        ``done_reason`` overrides what upstream reported (``"stop"`` or ``"length"``; ``"stop"``
        if it reported nothing). ``prompt_eval_count`` is the whole prompt, cached tokens
        included (like OpenAI's ``prompt_tokens``); ``prompt_eval_duration`` is the time spent
        on the tokens actually evaluated. Tool calls not yet sent go in this chunk's message.
        """
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = ""
        else:
            message: dict[str, Any] = {"role": "assistant", "content": ""}
            if self._tool_calls and not self._tool_calls_sent:
                self._tool_calls_sent = True
                message["tool_calls"] = self._ollama_tool_calls()
            chunk["message"] = message
        chunk["done"] = True
        chunk["done_reason"] = done_reason or self._done_reason or "stop"
        chunk.update(self._metrics(load_duration_ns, total_duration_ns))
        return chunk

    def aggregate(
        self, *, load_duration_ns: int, total_duration_ns: int, done_reason: str | None = None
    ) -> dict[str, Any]:
        """The whole response as one Ollama object, for ``stream: false``.

        Call after feeding every event; the text, thinking, tool calls and logprobs gathered,
        plus :meth:`finish`'s fields.
        """
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = self.text
            if self._thinking:
                chunk["thinking"] = "".join(self._thinking)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self._thinking:
                message["thinking"] = "".join(self._thinking)
            if self._tool_calls:
                message["tool_calls"] = self._ollama_tool_calls()
            chunk["message"] = message
        chunk["done"] = True
        chunk["done_reason"] = done_reason or self._done_reason or "stop"
        chunk.update(self._metrics(load_duration_ns, total_duration_ns))
        if self._logprobs:
            chunk["logprobs"] = list(self._logprobs)
        return chunk


def _token_logprob(p: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's ``TokenLogprob``: ``token``, ``logprob`` and, when llama-server gave them, the
    token's ``bytes`` (a token may be part of a UTF-8 character)."""
    out: dict[str, Any] = {"token": str(p.get("token", "")), "logprob": float(p.get("logprob", 0.0))}
    raw = p.get("bytes")
    if isinstance(raw, list) and raw:
        out["bytes"] = raw
    return out


def _logprob_from_openai(p: Mapping[str, Any], top: int) -> dict[str, Any]:
    """Ollama's ``Logprob`` for one OpenAI ``logprobs.content`` entry, with at most ``top``
    alternatives (none for 0: Ollama's ``top_logprobs`` is omitted then; llama-server was asked
    for at least one, as it reports nothing for 0)."""
    out = _token_logprob(p)
    alternatives = p.get("top_logprobs")
    if top and isinstance(alternatives, list) and alternatives:
        out["top_logprobs"] = [_token_logprob(t) for t in alternatives[:top] if isinstance(t, Mapping)]
    return out


def _logprob_from_completion(p: Mapping[str, Any], top: int) -> dict[str, Any]:
    """Ollama's logprob entry for one ``/completion`` ``completion_probabilities`` entry."""
    return _logprob_from_openai(p, top)
