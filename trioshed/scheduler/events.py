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
import sys
import time
from array import array
from dataclasses import dataclass

import trio

from trioshed._util import RingIndex
from trioshed.errors import TrioshedError

HISTORY = 1024  # events held; /metrics is scraped far more often than this many loads happen


def cause_of(error: TrioshedError) -> str:
    """A refusal's cause as a label: the error's class name in snake case (``queue_full``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


@dataclass(frozen=True, slots=True)
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
    """The last :data:`HISTORY` events and a way to wait for the next one.

    Held as a ring allocated once (:class:`~trioshed._util.RingIndex`): each event's numbers in
    arrays, its kind and model (interned: a thousand events name a few) and its reason in lists;
    :meth:`after` builds the :class:`SchedulerEvent`\\ s it returns. An event lives for minutes
    (the soak: ~3 a second), and an object per event (with its time, its sequence number) held a
    few small blocks each among short-lived ones in CPython's arenas, which an arena goes back
    only once all of its blocks are free.
    """

    def __init__(self, size: int = HISTORY) -> None:
        self._ring = RingIndex(size)
        self._seqs = array("q", bytes(8 * size))
        self._times = array("d", bytes(8 * size))
        self._seconds = array("d", bytes(8 * size))
        self._statuses = array("q", bytes(8 * size))
        self._counts = array("q", bytes(8 * size))
        self._kinds = [""] * size
        self._models = [""] * size
        self._reasons = [""] * size
        self._seq = 0
        self._changed = trio.Event()  # swapped for a fresh one on every change

    @property
    def last_seq(self) -> int:
        """The newest event's sequence number (0: none yet); a refusal folded in moves it too."""
        return self._seq

    def add(self, kind: str, model: str, reason: str = "", seconds: float = 0.0, status: int = 0) -> None:
        now = time.time()
        self._seq += 1
        last = self._ring.last()
        if (
            kind == "refused"
            and last is not None
            and (self._kinds[last], self._models[last], self._reasons[last], self._statuses[last]) == (kind, model, reason, status)
        ):
            self._seqs[last] = self._seq
            self._times[last] = now
            self._counts[last] += 1
        else:
            at = self._ring.push()
            self._seqs[at], self._times[at], self._seconds[at] = self._seq, now, seconds
            self._statuses[at], self._counts[at] = status, 1
            # kinds and models are a few names, interned; a reason may be any text (a crash's
            # output), kept as it is rather than adding to the interpreter's table of names
            self._kinds[at], self._models[at], self._reasons[at] = sys.intern(kind), sys.intern(model), reason
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
        return tuple(
            SchedulerEvent(
                self._seqs[at], self._times[at], self._kinds[at], self._models[at], self._reasons[at],
                self._seconds[at], self._statuses[at], self._counts[at],
            )
            for at in self._ring.positions() if self._seqs[at] > seq
        )  # fmt: skip

    async def wait_after(self, seq: int) -> tuple[SchedulerEvent, ...]:
        """Wait until there is an event newer than ``seq``; return those held (oldest first)."""
        while self._seq <= seq:
            await self._changed.wait()
        return self.after(seq)


TIMELINE = 3600  # samples held: one a second, the last hour
AHEAD = 120  # seconds not sampled yet whose tokens are held (a request reaching past the sampler)


@dataclass(frozen=True, slots=True)
class Sample:
    """One second of the server, for the status page's pictures.

    ``tokens``: tokens generated in that second, per model (a finished request's tokens are
    spread evenly over the seconds it generated them: the sample of a second already sent is
    then sent again, with a new ``seq``, as a folded refusal is); ``waiting``: requests waiting
    per model; ``memory``: per device, the bytes each runner holds there, a runner's prompt-cache
    reservation apart (``"<model> · prompt cache"``).
    """

    seq: int
    time: int  # wall-clock second
    tokens: tuple[tuple[str, int], ...] = ()
    waiting: tuple[tuple[str, int], ...] = ()
    memory: tuple[tuple[str, str, int], ...] = ()  # (device id, runner label, bytes)

    @property
    def idle(self) -> bool:
        return not (self.tokens or self.waiting or self.memory)

    def as_json(self) -> dict[str, object]:
        memory: dict[str, dict[str, int]] = {}
        for device, label, nbytes in self.memory:
            memory.setdefault(device, {})[label] = nbytes
        return {"seq": self.seq, "time": self.time, "tokens": dict(self.tokens), "waiting": dict(self.waiting), "memory": memory}


class Timeline:
    """The last :data:`TIMELINE` seconds as :class:`Sample`\\ s, and a way to wait for the next.

    Plain data: the sampler (:func:`trioshed.scheduler.timeline.run_timeline`) records what the
    scheduler holds once a second while anything is loaded or waiting, and one idle sample when
    it all goes away (a gap after an idle sample means nothing happened); the HTTP edge adds each
    finished request's generated tokens. Bounded: at most :data:`TIMELINE` samples, and tokens
    for seconds not yet sampled only while they are within a minute of now.

    Held as a ring of plain numbers, allocated once: each sample's time and sequence number, and
    one column of numbers per (what, model or device and label) that has been seen, one cell a
    sample; :meth:`after` builds the :class:`Sample`\\ s it returns. So an hour of samples costs
    its columns from the first minute on, instead of growing for an hour (a column that holds
    nothing any more is taken for the next new one).
    """

    def __init__(self, size: int = TIMELINE) -> None:
        self._size = size
        self._times = array("q", bytes(8 * size))
        self._seqs = array("q", bytes(8 * size))
        self._first = 0  # ring position of the oldest sample held
        self._count = 0
        # ("tokens", model, "") / ("waiting", model, "") / ("memory", device, label): one cell a position
        self._columns: dict[tuple[str, str, str], array[int]] = {}
        self._ahead: dict[int, dict[str, int]] = {}  # tokens of seconds not sampled yet
        self._seq = 0
        self._changed = trio.Event()

    @property
    def last_seq(self) -> int:
        return self._seq

    def _bump(self) -> int:
        self._seq += 1
        self._changed.set()
        self._changed = trio.Event()
        return self._seq

    def _pos(self, i: int) -> int:
        """The ring position of the ``i``-th sample held, oldest first."""
        return (self._first + i) % self._size

    def _column(self, key: tuple[str, str, str]) -> array[int]:
        column = self._columns.get(key)
        if column is None:
            empty = next((k for k, c in self._columns.items() if not any(c)), None)
            column = self._columns.pop(empty) if empty is not None else array("q", bytes(8 * self._size))
            self._columns[key] = column
        return column

    def _held(self, pos: int, kind: str) -> dict[str, int]:
        return {k[1]: c[pos] for k, c in self._columns.items() if k[0] == kind and c[pos]}

    def _idle(self, pos: int) -> bool:
        return not any(c[pos] for c in self._columns.values())

    def record(
        self,
        second: int,
        waiting: dict[str, int],
        memory: list[tuple[str, str, int]],
    ) -> None:
        """The sample of ``second`` (a later call for the same second replaces it)."""
        tokens = self._ahead.pop(second, {})
        for old in [s for s in self._ahead if s < second - 60]:
            del self._ahead[old]
        if self._count and self._times[self._pos(self._count - 1)] >= second:
            last = self._pos(self._count - 1)
            if self._times[last] > second:
                return  # the wall clock went back: keep the timeline monotonic
            tokens = {**self._held(last, "tokens"), **tokens}
            self._count -= 1
        cells = [(("tokens", m, ""), n) for m, n in tokens.items() if n]
        cells += [(("waiting", m, ""), n) for m, n in waiting.items() if n]
        cells += [(("memory", device, label), n) for device, label, n in memory if n]
        if not cells and self._count and self._idle(self._pos(self._count - 1)):
            return  # idle stays idle: one sample says so
        if self._count == self._size:
            self._first = self._pos(1)
            self._count -= 1
        pos = self._pos(self._count)
        for column in self._columns.values():
            column[pos] = 0
        for key, n in cells:
            self._column(key)[pos] += n
        self._times[pos] = second
        self._seqs[pos] = self._bump()
        self._count += 1

    def add_tokens(self, model: str, count: int, start: float, end: float) -> None:
        """``count`` tokens of ``model`` generated from ``start`` to ``end`` (wall clock)."""
        if count <= 0 or not model:
            return
        first, last = int(start), max(int(start), int(end))
        seconds = last - first + 1
        if seconds > TIMELINE:
            first, seconds = last - TIMELINE + 1, TIMELINE
        share, rest = divmod(count, seconds)
        # The request's seconds are the newest ones: walk back from the newest sample only as far
        # as the request reaches (a few entries, not the whole hour).
        at = self._count - 1
        newest = self._times[self._pos(at)] if self._count else None
        for n, second in reversed(list(enumerate(range(first, last + 1)))):
            add = share + (1 if n < rest else 0)
            if not add:
                continue
            if newest is None or second > newest:
                ahead = self._ahead.setdefault(second, {})
                ahead[model] = ahead.get(model, 0) + add
                while len(self._ahead) > AHEAD:  # bounded even with no sampler running
                    del self._ahead[min(self._ahead)]
                continue
            while at >= 0 and self._times[self._pos(at)] > second:
                at -= 1
            if at < 0:
                break  # older than anything held: dropped
            pos = self._pos(at)
            if self._times[pos] != second:
                continue  # a second not sampled (idle): nothing to add to
            self._column(("tokens", model, ""))[pos] += add
            self._seqs[pos] = self._bump()

    def after(self, seq: int = 0) -> tuple[Sample, ...]:
        """The samples held newer than ``seq`` (in time order)."""
        if seq >= self._seq:
            return ()
        columns = sorted(self._columns.items())
        out = []
        for i in range(self._count):
            pos = self._pos(i)
            if self._seqs[pos] <= seq:
                continue
            cells = [(k, c[pos]) for k, c in columns if c[pos]]
            out.append(Sample(
                self._seqs[pos], self._times[pos],
                tuple((k[1], n) for k, n in cells if k[0] == "tokens"),
                tuple((k[1], n) for k, n in cells if k[0] == "waiting"),
                tuple((k[1], k[2], n) for k, n in cells if k[0] == "memory"),
            ))  # fmt: skip
        return tuple(out)

    async def wait_after(self, seq: int) -> None:
        while self._seq <= seq:
            await self._changed.wait()
