"""The recent requests, for the status page: a bounded list of what each request waited for.

The HTTP edge adds each finished request that named a model (:meth:`RecentRequests.add`, from
its :class:`~trioshed.trace.RequestTrace`); the page's stream follows the list by sequence
number, as it follows the scheduler's events. Plain data and one ``trio.Event``: a few
attribute reads per request, nothing per token.

Held as a ring allocated once, as the scheduler's events are: each request's numbers in arrays
(a missing one as NaN or -1), its names interned and its words in lists; :meth:`RecentRequests.after`
builds the :class:`FinishedRequest`\\ s it returns. An object per request, with its six floats,
held small blocks among short-lived ones in CPython's arenas for as long as the request was among
the last :data:`RECENT`.
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from dataclasses import asdict, dataclass, fields

import trio

from trioshed._util import RingIndex
from trioshed.trace import RequestTrace

RECENT = 200  # requests held
SLOW_QUEUE = 0.5  # seconds in the queue (beyond a load) worth a word on the page
#: The routes whose requests the page lists: those that name a model.
MODEL_ROUTES = frozenset({
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens",
})  # fmt: skip


def protocol_of(route: str) -> str:
    if route.startswith("/v1/messages"):
        return "anthropic"
    if route.startswith("/v1/"):
        return "openai"
    if route.startswith("/api/"):
        return "ollama"
    return "other"


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    seq: int
    time: float  # wall clock, when the answer ended
    key: str  # the API key's name ("" without keys)
    model: str  # "" when the request never reached one (refused before)
    protocol: str
    route: str
    status: int  # 0: the client left before an answer
    queue_wait: float | None  # seconds, loads included
    load_wait: float | None
    ttft: float | None  # seconds from arrival to the first token (queue + prompt), where known
    prompt_tokens: int | None
    eval_tokens: int | None
    tokens_per_second: float | None  # generation speed, where llama-server timed it
    duration: float
    slow: str  # why it waited, in words ("" when it did not)

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def _took(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def why_slow(trace: RequestTrace) -> str:
    """In words, what the request waited for: a load (any: it was the first on its runner), the
    queue (beyond :data:`SLOW_QUEUE`), a restored conversation, or why it was refused."""
    words = []
    if trace.load_wait:
        words.append(f"waited {_took(trace.load_wait)} for a load")
    queued = (trace.queue_wait or 0.0) - (trace.load_wait or 0.0)
    if queued >= SLOW_QUEUE:
        words.append(f"waited {_took(queued)} in the queue")
    if trace.restore_seconds:
        words.append(f"restored a saved conversation in {trace.restore_seconds * 1000:.0f} ms")
    if trace.error:
        words.append(f"refused: {trace.error}")
    return "; ".join(words)


_FLOATS = ("time", "queue_wait", "load_wait", "ttft", "tokens_per_second", "duration")  # NaN: None
_INTS = ("seq", "status", "prompt_tokens", "eval_tokens")  # -1: None
_NAMES = ("key", "model", "protocol", "route")  # a few of each: interned
_OPTIONAL = frozenset({"queue_wait", "load_wait", "ttft", "tokens_per_second", "prompt_tokens", "eval_tokens"})
_ORDER = tuple(f.name for f in fields(FinishedRequest))


class RecentRequests:
    """The last :data:`RECENT` finished requests that named a model."""

    def __init__(self, size: int = RECENT) -> None:
        self._ring = RingIndex(size)
        self._floats = {name: array("d", bytes(8 * size)) for name in _FLOATS}
        self._ints = {name: array("q", bytes(8 * size)) for name in _INTS}
        self._words: dict[str, list[str]] = {name: [""] * size for name in (*_NAMES, "slow")}
        self._seq = 0
        self._changed = trio.Event()

    def add(self, trace: RequestTrace, duration: float) -> FinishedRequest | None:
        if not trace.model and trace.route not in MODEL_ROUTES:
            return None
        self._seq += 1
        ttft = None
        if trace.prompt_seconds is not None:
            ttft = (trace.queue_wait or 0.0) + (trace.restore_seconds or 0.0) + trace.prompt_seconds
        speed = None
        if trace.eval_seconds and trace.eval_tokens:
            speed = trace.eval_tokens / trace.eval_seconds
        item = FinishedRequest(
            self._seq, time.time(), trace.key, trace.model, protocol_of(trace.route), trace.route,
            trace.status, trace.queue_wait, trace.load_wait, ttft, trace.prompt_tokens,
            trace.eval_tokens, speed, duration, why_slow(trace),
        )  # fmt: skip
        at = self._ring.push()
        for name in _FLOATS:
            value = getattr(item, name)
            self._floats[name][at] = math.nan if value is None else value
        for name in _INTS:
            value = getattr(item, name)
            self._ints[name][at] = -1 if value is None else value
        for name in _NAMES:
            self._words[name][at] = sys.intern(getattr(item, name))
        self._words["slow"][at] = item.slow
        self._changed.set()
        self._changed = trio.Event()
        return item

    def _item(self, at: int) -> FinishedRequest:
        values: dict[str, object] = {}
        for name in _FLOATS:
            value = self._floats[name][at]
            values[name] = None if math.isnan(value) else value
        for name in _INTS:
            number = self._ints[name][at]
            values[name] = None if number < 0 and name in _OPTIONAL else number
        for name, column in self._words.items():
            values[name] = column[at]
        return FinishedRequest(*(values[name] for name in _ORDER))  # type: ignore[arg-type]

    def after(self, seq: int = 0) -> tuple[FinishedRequest, ...]:
        if seq >= self._seq:
            return ()
        seqs = self._ints["seq"]
        return tuple(self._item(at) for at in self._ring.positions() if seqs[at] > seq)

    async def wait_after(self, seq: int) -> None:
        while self._seq <= seq:
            await self._changed.wait()
