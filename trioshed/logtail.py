"""The log's last lines, kept in memory for the status page (``GET /ui``, ``GET /api/events``).

A :class:`LogTail` is a :class:`logging.Handler` holding the last ``capacity`` records as small
frozen :class:`LogLine`\\ s, numbered in order. It never grows beyond ``capacity`` and never
blocks: a reader that fell behind gets what is still held and is told it missed some.

Held as a ring allocated once: each line's number and time in arrays, its level and logger
(interned: a few of each) and its message in lists; :meth:`LogTail.since` builds the
:class:`LogLine`\\ s it returns. A line lives for minutes under a load (the soak logs a line every
second or two), and an object per line (with its time) held small blocks among short-lived
ones in CPython's arenas, which an arena goes back only once all of its blocks are free.

Records may come from worker threads (``trio.to_thread``); :meth:`wait_changed` wakes Trio
waiters through the run's token in that case.
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from dataclasses import dataclass

import trio
from trio_util import RepeatedEvent

from trioshed._util import RingIndex

CAPACITY = 500  # lines: about 60 KB held, and what a page receives when it (re)connects
MAX_MESSAGE = 2000  # characters per line: a pasted prompt in a warning must not fill the page


@dataclass(frozen=True, slots=True)
class LogLine:
    seq: int
    time: float  # wall clock, seconds
    level: str
    logger: str
    message: str


class LogTail(logging.Handler):
    def __init__(self, capacity: int = CAPACITY, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.capacity = capacity
        self._seqs = array("q", bytes(8 * capacity))
        self._times = array("d", bytes(8 * capacity))
        self._levels = [""] * capacity
        self._loggers = [""] * capacity
        self._messages = [""] * capacity
        self._ring = RingIndex(capacity)
        self._seq = 0
        self._guard = threading.Lock()
        self._changed = RepeatedEvent()
        self._token: trio.lowlevel.TrioToken | None = None

    async def run_installed(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the root logger's records until cancelled (``await nursery.start(tail.run_installed)``)."""
        self._token = trio.lowlevel.current_trio_token()
        root = logging.getLogger()
        root.addHandler(self)
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            root.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "…"
        with self._guard:
            self._seq += 1
            at = self._ring.push()
            self._seqs[at], self._times[at] = self._seq, record.created
            self._levels[at], self._loggers[at] = sys.intern(record.levelname), sys.intern(record.name)
            self._messages[at] = message
        self._wake()

    def _wake(self) -> None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # another thread (or no run): hand the wake-up to the run
            if self._token is not None:
                try:
                    self._token.run_sync_soon(self._changed.set)
                except trio.RunFinishedError:
                    pass
            return
        self._changed.set()

    @property
    def last_seq(self) -> int:
        return self._seq

    def since(self, seq: int) -> tuple[list[LogLine], bool]:
        """The lines after ``seq``, and whether some after it are no longer held."""
        with self._guard:
            lines = [
                LogLine(self._seqs[at], self._times[at], self._levels[at], self._loggers[at], self._messages[at])
                for at in self._ring.positions() if self._seqs[at] > seq
            ]  # fmt: skip
        gap = bool(lines) and lines[0].seq > seq + 1
        return lines, gap

    async def wait_changed(self) -> None:
        await self._changed.wait()
