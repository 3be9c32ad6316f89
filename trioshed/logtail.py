"""The log's last lines, kept in memory for the status page (``GET /ui``, ``GET /api/events``).

A :class:`LogTail` is a :class:`logging.Handler` holding the last ``capacity`` records as small
frozen :class:`LogLine`\\ s, numbered in order. It never grows beyond ``capacity`` and never
blocks: a reader that fell behind gets what is still held and is told it missed some.

Records may come from worker threads (``trio.to_thread``); :meth:`wait_changed` wakes Trio
waiters through the run's token in that case.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import trio
from trio_util import RepeatedEvent

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
        self._lines: deque[LogLine] = deque(maxlen=capacity)
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
            self._lines.append(LogLine(self._seq, record.created, record.levelname, record.name, message))
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
            lines = [line for line in self._lines if line.seq > seq]
        gap = bool(lines) and lines[0].seq > seq + 1
        return lines, gap

    async def wait_changed(self) -> None:
        await self._changed.wait()
