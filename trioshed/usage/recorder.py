"""The usage writer ``serve()`` runs: finished requests go to the ledger at once (budgets) and,
batched once a second, into SQLite from a worker thread (the event loop never waits on the disk).

At most the last second is lost when the process is killed; a clean stop writes what is left.
A database that cannot be written (locked, read-only, full, corrupt) is logged once per cause
and tried again each second; meanwhile rows wait in memory, up to ``bound`` of them: beyond it
they are counted as dropped (``dropped``, and a log line).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import trio

from trioshed.trace import RequestTrace
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import Ledger, Spend

log = logging.getLogger(__name__)

BOUND = 100_000  # rows kept in memory while the database cannot be written


def describe(exc: BaseException) -> str:
    """What is wrong with the database, in words a user acts on."""
    text = str(exc).lower()
    if "locked" in text or "busy" in text:
        return "is locked by another program"
    if "readonly" in text or "read-only" in text or "permission" in text or "unable to open" in text:
        return "cannot be written (read-only file or folder)"
    if "full" in text or "no space" in text:
        return "cannot grow: the disk is full"
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return "is corrupt; move the file away and trioshed starts a new one"
    return f"cannot be used: {exc}"


class UsageRecorder:
    def __init__(self, path: Path | None, *, bound: int = BOUND, interval: float = 1.0) -> None:
        self.ledger = Ledger()
        self.path = path
        self.db = UsageDB(path) if path is not None else None
        self.pending: list[Spend] = []
        self.bound = bound
        self.interval = interval
        self.dropped = 0
        self.written = 0
        self.problem = ""  # the database's fault now, "" when none
        self._seeded = False
        self._lock = trio.Lock()

    def record_trace(self, trace: RequestTrace) -> None:
        """A finished request (the HTTP edge's trace): counted when it reached a model."""
        if not trace.model:
            return
        self.record(
            Spend(
                trace.key, trace.model, time.time(),
                prompt=trace.prompt_tokens or 0, cached=trace.cached_tokens or 0,
                completion=trace.eval_tokens or 0, error=trace.status >= 400,
                seconds=trace.gen_seconds or 0.0,
            )
        )  # fmt: skip

    def record(self, spend: Spend) -> None:
        self.ledger.spend(spend)
        if self.db is None:
            return
        if len(self.pending) >= self.bound:
            self._drop(1)
            return
        self.pending.append(spend)

    def _drop(self, n: int) -> None:
        if not self.dropped:
            log.error("usage database %s %s: more than %d rows waiting, dropping usage rows from now on", self.path, self.problem or "is slow", self.bound)
        self.dropped += n

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: write the rows once a second; at the end, what is left."""
        if self.db is not None:
            async with self._lock:
                await self._open()
        task_status.started()
        if self.db is None:
            await trio.sleep_forever()
        try:
            while True:
                await trio.sleep(self.interval)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self.flush()
                if self.db is not None:
                    await trio.to_thread.run_sync(self.db.close)

    async def _open(self) -> bool:
        """Open the database and read today's spends into the ledger (once); False on a fault."""
        assert self.db is not None
        try:
            if not self.db.is_open:
                await trio.to_thread.run_sync(self.db.open)
            if not self._seeded:
                for name, prompt, completion in await trio.to_thread.run_sync(self.db.today, time.time()):
                    self.ledger.seed(name, time.time(), prompt, completion)
                self._seeded = True
        except (sqlite3.Error, OSError) as exc:
            self._fault(exc)
            return False
        return True

    async def flush(self) -> None:
        """Write the waiting rows now (one transaction); on a fault they wait for the next try."""
        if self.db is None:
            return
        async with self._lock:
            if not self.pending or not await self._open():
                return
            batch, self.pending = self.pending, []
            try:
                await trio.to_thread.run_sync(self.db.write, batch, time.time())
            except (sqlite3.Error, OSError) as exc:
                self._fault(exc)
                self.pending = batch + self.pending
                if len(self.pending) > self.bound:
                    self._drop(len(self.pending) - self.bound)
                    del self.pending[self.bound :]
                return
            self.written += len(batch)
            if self.problem:
                log.warning("usage database %s can be written again (%d rows written)", self.path, len(batch))
                self.problem = ""

    def _fault(self, exc: BaseException) -> None:
        problem = describe(exc)
        if problem != self.problem:
            log.error(
                "usage database %s %s; serving continues, usage waits in memory (up to %d rows) and is written once it can be",
                self.path, problem, self.bound,
            )  # fmt: skip
            self.problem = problem
        if "locked" not in problem and self.db is not None:
            self.db.close()  # opened afresh next time (the file may have been fixed or moved away)

    async def query(self, **filters: Any) -> list[dict[str, Any]]:
        """Rows of the database (see :meth:`UsageDB.query`), after writing what waits."""
        if self.db is None:
            return []
        await self.flush()
        async with self._lock:
            if not await self._open():
                raise OSError(f"usage database {self.problem}")
            return await trio.to_thread.run_sync(lambda: self.db.query(**filters))  # type: ignore[union-attr]
