"""Anthropic's Messages API: llama-server's answer as Anthropic's message and event stream, without I/O.

:class:`MessageStream` reads llama-server's streamed events (``/v1/chat/completions`` chunks or
``/completion`` events; it tells them apart by shape) and gives Anthropic's events::

    message_start            {"message": {"id": "msg_…", "content": [], "usage": {"input_tokens": …}}}
    ping                     (one per prompt-progress report: the prompt is being read)
    content_block_start      {"index": i, "content_block": {"type": "text", "text": ""}}
    content_block_delta      {"index": i, "delta": {"type": "text_delta", "text": …}}
    content_block_stop       {"index": i}
    …                        thinking blocks (thinking_delta), tool_use blocks (input_json_delta)
    message_delta            {"delta": {"stop_reason", "stop_sequence"}, "usage": {…}}
    message_stop

or, for a whole answer, :meth:`MessageStream.message`: the same content as one message.

* ``stop_reason``: ``tool_use`` when the model called a tool, ``max_tokens`` at the token limit,
  ``stop_sequence`` (with ``stop_sequence`` naming it) when a client's stop sequence ended the
  answer, else ``end_turn``.
* On the chat path the client's stop sequences are matched here: text that might begin one is
  held back until it cannot, and on a match the text before it is sent and the stream is over
  (:attr:`MessageStream.cut`: the route stops reading, which ends the generation upstream).
* ``usage``: ``input_tokens`` is the prompt less what llama-server's cache held, which is
  ``cache_read_input_tokens`` (Anthropic's meaning: the three add up to the whole prompt). They
  are known from the first event (``return_progress``), so ``message_start`` has them.
  ``output_tokens`` is llama-server's count; after a cut, the pieces received (one per token).
* A final assistant message that llama-server continues (a prefill) is echoed at the start of its
  stream; the echo is stripped, as Anthropic's answer holds only the continuation.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trioshed.api.protocols.errors import anthropic_error
from trioshed.api.protocols.llama import parse_sse_line, strip_echo, upstream_error_message
from trioshed.errors import UpstreamError

__all__ = ["Event", "MessageStream", "encode_events", "error_event", "new_id"]

#: One Anthropic event: its name (the SSE ``event:`` line) and its data.
Event = tuple[str, dict[str, Any]]

_FINISH = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
_STOP_TYPES = {"limit": "max_tokens", "eos": "end_turn", "none": "end_turn"}


def new_id(prefix: str) -> str:
    """An id in Anthropic's style (``msg_…``, ``toolu_…``): the prefix and 24 random hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


def encode_events(events: Iterable[Event]) -> bytes:
    """Events as SSE: an ``event:`` line naming each and its ``data:`` line."""
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
        for name, data in events
    )


def error_event(status: int, message: str) -> bytes:
    """The last event of a stream that failed after it started, in Anthropic's error shape."""
    return encode_events([("error", anthropic_error(status, message))])


class MessageStream:
    """Stateful translator of one llama-server stream into Anthropic's events (one per request).

    Feed it each upstream event in order (:meth:`feed`, or :meth:`feed_lines` for raw lines);
    then :meth:`finish` gives the closing events, or :meth:`message` the whole answer. Stop
    reading upstream once :attr:`cut` is true; a stream that ends before :attr:`finished` was cut
    short (the runner died).
    """

    def __init__(
        self,
        model: str,
        *,
        message_id: str | None = None,
        stop_sequences: Iterable[str] = (),
        turn_stop: str | None = None,
        prefill: str = "",
        tool_id: Callable[[], str] = lambda: new_id("toolu"),
    ) -> None:
        self.model = model
        self.id = message_id or new_id("msg")
        self._stops = tuple(s for s in stop_sequences if s)
        self._turn_stop = turn_stop
        self._echo = prefill
        self._tool_id = tool_id
        self._started = False
        self._blocks: list[dict[str, Any]] = []  # the message's content, for message()
        self._open: int | None = None  # index of the block being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # upstream tool-call index -> its state
        self._held = ""  # text that may be the start of a stop sequence
        self._stop_reason: str | None = None
        self._stop_sequence: str | None = None
        self._prompt: int | None = None
        self._cached = 0
        self._output: int | None = None
        self._pieces = 0
        self.cut = False

    @property
    def finished(self) -> bool:
        """Whether the answer's end was seen (upstream's finish, or a stop sequence)."""
        return self._stop_reason is not None

    # -- feeding ------------------------------------------------------------------------------

    def feed_lines(self, lines: Iterable[bytes | str]) -> list[Event]:
        """The events for a batch of upstream SSE lines."""
        return [e for line in lines if (event := parse_sse_line(line)) is not None for e in self.feed(event)]

    def feed(self, event: Mapping[str, Any]) -> list[Event]:
        """The events for one upstream event. Raises :class:`UpstreamError` for an error event."""
        if "error" in event:
            raise UpstreamError(f"llama-server error: {upstream_error_message(event)}")
        progress = event.get("prompt_progress")
        if isinstance(progress, Mapping) and not self.cut:
            self._note_prompt(progress.get("total"), progress.get("cache"))
        out = self._start()
        if self.cut:
            return out
        if isinstance(progress, Mapping):
            out.append(("ping", {"type": "ping"}))
        if "choices" in event:
            self._feed_chat(event, out)
        else:
            self._feed_completion(event, out)
        return out

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        message = self._shell()
        message["usage"]["output_tokens"] = 0
        return [("message_start", {"type": "message_start", "message": message})]

    def _note_prompt(self, total: object, cached: object) -> None:
        if isinstance(total, int) and not isinstance(total, bool):
            self._prompt = total
        if isinstance(cached, int) and not isinstance(cached, bool):
            self._cached = cached

    def _feed_chat(self, event: Mapping[str, Any], out: list[Event]) -> None:
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
            self._note_prompt(usage.get("prompt_tokens"), cached)
            if isinstance(usage.get("completion_tokens"), int):
                self._output = usage["completion_tokens"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            if thinking := delta.get("reasoning_content"):
                self._pieces += 1
                self._flush_text(out)
                self._delta(out, "thinking", {"type": "thinking_delta", "thinking": thinking})
            if content := delta.get("content"):
                self._pieces += 1
                self._text(content, out)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, Mapping):
                    self._pieces += 1
                    self._tool_call(call, out)
            reason = choice.get("finish_reason")
            if reason is not None and not self.cut:
                self._flush_text(out)
                self._stop_reason = _FINISH.get(str(reason), "end_turn")

    def _feed_completion(self, event: Mapping[str, Any], out: list[Event]) -> None:
        if content := event.get("content"):
            self._pieces += 1
            self._text(str(content), out)
        if not event.get("stop"):
            return
        self._note_prompt(event.get("tokens_evaluated"), (event.get("timings") or {}).get("cache_n"))
        if isinstance(event.get("tokens_predicted"), int):
            self._output = event["tokens_predicted"]
        self._flush_text(out)
        word = event.get("stopping_word")
        if event.get("stop_type") == "word" and word and word != self._turn_stop:
            self._stop_reason, self._stop_sequence = "stop_sequence", str(word)
        else:
            self._stop_reason = _STOP_TYPES.get(str(event.get("stop_type")), "end_turn")

    # -- content blocks -------------------------------------------------------------------------

    def _open_block(self, out: list[Event], block: dict[str, Any]) -> int:
        self._close_block(out)
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        shown = {k: v for k, v in block.items() if not k.startswith("_")}
        out.append(("content_block_start", {"type": "content_block_start", "index": self._open, "content_block": shown}))
        return self._open

    def _close_block(self, out: list[Event]) -> None:
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._open}))
            self._open = None

    def _delta(self, out: list[Event], kind: str, delta: dict[str, Any]) -> None:
        """Append ``delta`` to the open block of ``kind`` (a new one if another kind is open)."""
        if self._open is None or self._blocks[self._open]["type"] != kind:
            self._open_block(out, {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""})
        assert self._open is not None
        block = self._blocks[self._open]
        key = "text" if kind == "text" else "thinking"
        block[key] += delta[key]
        out.append(("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta}))

    def _text(self, content: str, out: list[Event]) -> None:
        content, self._echo = strip_echo(self._echo, content)
        if not content:
            return
        text = self._held + content
        self._held = ""
        if self._stops:
            hit = min(((i, s) for s in self._stops if (i := text.find(s)) >= 0), default=None)
            if hit is not None:
                index, stop = hit
                self._emit_text(text[:index], out)
                self._stop_reason, self._stop_sequence, self.cut = "stop_sequence", stop, True
                return
            keep = max((n for s in self._stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), default=0)
            text, self._held = (text[:-keep], text[-keep:]) if keep else (text, "")
        self._emit_text(text, out)

    def _emit_text(self, text: str, out: list[Event]) -> None:
        if text:
            self._delta(out, "text", {"type": "text_delta", "text": text})

    def _flush_text(self, out: list[Event]) -> None:
        """The held-back text: what follows it shows that it began no stop sequence."""
        held, self._held = self._held, ""
        self._emit_text(held, out)

    def _tool_call(self, call: Mapping[str, Any], out: list[Event]) -> None:
        index = call.get("index", len(self._calls))
        state = self._calls.setdefault(int(index) if isinstance(index, int) else len(self._calls), {"id": None, "name": "", "args": "", "block": None})
        function = call.get("function") or {}
        if isinstance(call.get("id"), str) and call["id"] and state["block"] is None:
            state["id"] = call["id"]
        if state["block"] is None:
            state["name"] += function.get("name") or ""
        state["args"] += function.get("arguments") or ""
        if state["block"] is None:
            if not state["name"]:
                return  # no name yet: the block starts when it comes
            self._flush_text(out)
            block = {"type": "tool_use", "id": state["id"] or self._tool_id(), "name": state["name"], "input": {}, "_args": ""}
            state["block"] = self._open_block(out, block)
            fragment = state["args"]
        else:
            fragment = function.get("arguments") or ""
            if self._open != state["block"]:  # llama-server interleaves no calls; be safe anyway
                return
        if fragment:
            self._blocks[state["block"]]["_args"] += fragment
            out.append(("content_block_delta", {"type": "content_block_delta", "index": state["block"],
                                                 "delta": {"type": "input_json_delta", "partial_json": fragment}}))

    # -- the end --------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        """The usage so far (the whole answer's once it finished)."""
        return self._usage()

    def _usage(self) -> dict[str, Any]:
        prompt = self._prompt or 0
        cached = min(self._cached, prompt)
        output = self._output if self._output is not None and not self.cut else self._pieces
        return {"input_tokens": prompt - cached, "output_tokens": output,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def _reason(self) -> str:
        if any(b["type"] == "tool_use" for b in self._blocks) and self._stop_reason != "max_tokens":
            return "tool_use"
        return self._stop_reason or "end_turn"

    def _shell(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self._usage()}

    def finish(self) -> list[Event]:
        """The closing events: the open block's stop, ``message_delta``, ``message_stop``."""
        out = self._start()
        self._flush_text(out)
        self._close_block(out)
        reason = self._reason()
        delta = {"stop_reason": reason, "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None}
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": self._usage()}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def message(self) -> dict[str, Any]:
        """The whole answer as one Anthropic message (after every event was fed).

        Raises :class:`UpstreamError` when the model called a tool with arguments that are not JSON.
        """
        self._flush_text([])
        content = []
        for block in self._blocks:
            shown = {k: v for k, v in block.items() if not k.startswith("_")}
            if block["type"] == "tool_use":
                shown["input"] = _arguments(block["name"], block["_args"])
            content.append(shown)
        reason = self._reason()
        return self._shell() | {"content": content, "stop_reason": reason,
                                "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None}


def _arguments(name: str, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise UpstreamError(f"the model called tool {name!r} with arguments that are not JSON: {raw[:200]!r}") from None
    if not isinstance(value, dict):
        raise UpstreamError(f"the model called tool {name!r} with arguments that are not a JSON object: {raw[:200]!r}")
    return value
