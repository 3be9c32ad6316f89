"""What happened to the scheduler, recently: a bounded history that readers follow.

Readers observe, nothing is called back (STYLE rule 10): ``/metrics`` reads the events after the
last one it counted at each scrape; a status page awaits :meth:`EventHistory.wait_after` and
renders what came. Each event has a sequence number that only grows; a reader keeps the last it
saw and asks for what came after (a reader further behind than the history holds gets the oldest
still held).

Refusals (503/429) can come thousands a second under a flood: one with the same status, cause and
model as the newest event is folded into it (``count`` grows, ``time`` is the latest) instead of
pushing loads and unloads out of the history.

Kinds: ``load`` (a load started), ``ready`` (``seconds``: the load's duration), ``evict``
(``reason``: why it was chosen), ``unloaded`` (``reason``), ``crashed``, ``load failed``
(``reason``: the error), ``refused`` (``status``: 503, 429, 507..., ``reason``: the error's class as a label, e.g.
``queue_full``, ``load_cooldown``, ``insufficient_memory``).
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, replace

import trio

from trioshed.errors import TrioshedError

HISTORY = 1024  # events held; /metrics is scraped far more often than this many loads happen


def cause_of(error: TrioshedError) -> str:
    """A refusal's cause as a label: the error's class name in snake case (``queue_full``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


@dataclass(frozen=True)
class SchedulerEvent:
    seq: int
    time: float  # wall clock, seconds since the epoch
    kind: str
    model: str  # the model's name ("" when a refusal is for no model in particular)
    reason: str = ""
    seconds: float = 0.0
    status: int = 0  # refusals: the HTTP status
    count: int = 1  # refusals folded into this one, itself included


class EventHistory:
    """The last :data:`HISTORY` events and a way to wait for the next one."""

    def __init__(self, size: int = HISTORY) -> None:
        self._events: deque[SchedulerEvent] = deque(maxlen=size)
        self._seq = 0
        self._changed = trio.Event()  # swapped for a fresh one on every change

    @property
    def last_seq(self) -> int:
        """The newest event's sequence number (0: none yet); a refusal folded in moves it too."""
        return self._seq

    def add(self, kind: str, model: str, reason: str = "", seconds: float = 0.0, status: int = 0) -> None:
        now = time.time()
        self._seq += 1
        last = self._events[-1] if self._events else None
        if (
            kind == "refused"
            and last is not None
            and (last.kind, last.model, last.reason, last.status) == (kind, model, reason, status)
        ):
            self._events[-1] = replace(last, seq=self._seq, time=now, count=last.count + 1)
        else:
            self._events.append(SchedulerEvent(self._seq, now, kind, model, reason, seconds, status))
        self._changed.set()
        self._changed = trio.Event()

    def refused(self, model: str, error: TrioshedError) -> None:
        """A request refused (its status and cause) before it got a runner."""
        self.add("refused", model, cause_of(error), status=error.status)

    def after(self, seq: int = 0) -> tuple[SchedulerEvent, ...]:
        """The events held newer than ``seq``, oldest first. A folded refusal whose ``seq`` moved
        past ``seq`` comes again with its whole ``count``: readers that count refusals subtract what
        they saw (``/metrics`` counts refusals from the HTTP edge, not from here)."""
        if seq >= self._seq:
            return ()
        return tuple(e for e in self._events if e.seq > seq)

    async def wait_after(self, seq: int) -> tuple[SchedulerEvent, ...]:
        """Wait until there is an event newer than ``seq``; return those held (oldest first)."""
        while self._seq <= seq:
            await self._changed.wait()
        return self.after(seq)
