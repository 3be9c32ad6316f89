"""The usage writer ``serve()`` runs: finished requests go to the ledger at once (budgets) and,
batched once a second, into the store (:mod:`trioshed.usage.store`: SQLite or PostgreSQL) from a
worker thread (the event loop never waits on the disk or the network).

After each write it reads what the other nodes spent (the shared store's ``others``) into the
ledger, so a budget holds for the team: a key's spend on one node is seen by every other node
within two intervals (its write, then their read; 2 s by default).

At most the last second is lost when the process is killed; a clean stop writes what is left.
A store that cannot be written (locked, read-only, full, corrupt, the database down) is logged
once per cause and tried again each second; meanwhile rows wait in memory, up to ``bound`` of
them: beyond it they are counted as dropped (``dropped``, and a log line). Budgets then count
what this node knows (fail open), or refuse keys with budgets (``fail_closed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from trioshed.errors import TrioshedError
from trioshed.keys import ApiKey
from trioshed.trace import RequestTrace
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import Ledger, Spend
from trioshed.usage.store import Store, StoreError

log = logging.getLogger(__name__)

BOUND = 100_000  # rows kept in memory while the database cannot be written
T = TypeVar("T")


class BudgetsUnknown(TrioshedError):
    """Budgets fail closed (TRIOSHED_BUDGETS_FAIL_CLOSED) and the shared store cannot be read."""

    status = 503

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(
            f"API key '{key}' has token budgets and the usage database {problem}: requests that spend "
            "tokens are refused until it is back (TRIOSHED_BUDGETS_FAIL_CLOSED)",
            headers={"Retry-After": "5"},
        )


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
    if "connect" in text or "connection" in text or "server closed" in text or "shutting down" in text:
        return "is unreachable"
    return f"cannot be used: {exc}"


@dataclass(frozen=True)
class StoreStatus:
    """The store as this node sees it now (``/api/ps``, ``/metrics``, the status page): its kind
    and where it is (a URL without its password), this node's name, whether the last use of it
    worked, the fault when not, and the rows waiting, dropped and written since start."""

    kind: str
    where: str
    node: str
    reachable: bool
    problem: str
    pending: int
    dropped: int
    written: int

    def as_json(self) -> dict[str, object]:
        return {"kind": self.kind, "where": self.where, "node": self.node, "reachable": self.reachable,
                "problem": self.problem or None, "pending": self.pending, "dropped": self.dropped}  # fmt: skip


class UsageRecorder:
    def __init__(
        self, store: Path | Store | None, *, bound: int = BOUND, interval: float = 1.0, node: str = "",
        fail_closed: bool = False,
    ) -> None:  # fmt: skip
        self.ledger = Ledger()
        self.db: Store | None = UsageDB(store) if isinstance(store, Path) else store
        self.where = self.db.where if self.db is not None else ""
        self.node = node
        self.fail_closed = fail_closed
        self.pending: list[Spend] = []
        self.writing = 0  # rows of the batch being written now (not in ``pending`` meanwhile)
        self.bound = bound
        self.interval = interval
        self.dropped = 0
        self.written = 0
        self.problem = ""  # the database's fault now, "" when none
        self.refreshed = 0.0  # when the other nodes' spends were last read (time.time())
        self._seeded = False
        self._lock = trio.Lock()

    @property
    def path(self) -> str:
        return self.where

    def statistics(self) -> StoreStatus | None:
        """A snapshot of the store's state on this node; None without a store (TRIOSHED_USAGE=0)."""
        if self.db is None:
            return None
        return StoreStatus(self.db.kind, self.where, self.node, not self.problem, self.problem,
                           self.waiting(), self.dropped, self.written)  # fmt: skip

    def waiting(self) -> int:
        """Rows not yet in the store: those in memory and the batch being written (a write to a
        database that just went away can take seconds to fail; its rows still wait)."""
        return len(self.pending) + self.writing

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

    def refusal(self, key: ApiKey, now: float) -> tuple[str, int, int] | None:
        """The ledger's answer (:meth:`Ledger.refusal`), counting every node's spends; with
        ``fail_closed``, BudgetsUnknown while the store cannot be reached."""
        if self.fail_closed and self.problem and key.budgets():
            raise BudgetsUnknown(key.name, self.problem)
        return self.ledger.refusal(key, now)

    def _drop(self, n: int) -> None:
        if not self.dropped:
            log.error("usage database %s %s: more than %d rows waiting, dropping usage rows from now on", self.where, self.problem or "is slow", self.bound)
        self.dropped += n

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: write the rows and read the team's spends once a second; at the end,
        write what is left."""
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
                await self.refresh()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self.flush()
                if self.db is not None:
                    await trio.to_thread.run_sync(self.db.close)

    async def _open(self) -> bool:
        """Open the store and read this node's spends of today into the ledger (once); False on a fault."""
        assert self.db is not None
        try:
            if not self.db.is_open:
                await trio.to_thread.run_sync(self.db.open)
            if not self._seeded:
                now = time.time()
                for name, prompt, completion in await trio.to_thread.run_sync(self.db.today, now, self.node):
                    self.ledger.seed(name, now, prompt, completion)
                self._seeded = True
        except StoreError as exc:
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
            self.writing = len(batch)
            try:
                await trio.to_thread.run_sync(self.db.write, batch, time.time(), self.node)
            except StoreError as exc:
                self._fault(exc)
                self.pending = batch + self.pending
                if len(self.pending) > self.bound:
                    self._drop(len(self.pending) - self.bound)
                    del self.pending[self.bound :]
                return
            finally:
                self.writing = 0
            self.written += len(batch)
            self._recovered(f"{len(batch)} rows written")

    async def refresh(self) -> None:
        """Read what the other nodes spent into the ledger; on a fault the last figures stay."""
        if self.db is None:
            return
        async with self._lock:
            if not await self._open():
                return
            now = time.time()
            try:
                others = await trio.to_thread.run_sync(self.db.others, now, self.node)
            except StoreError as exc:
                self._fault(exc)
                return
            self.ledger.set_others({o.key: (o.day_prompt, o.day_completion, o.minute_prompt, o.minute_completion) for o in others}, now)
            self.refreshed = now
            self._recovered("read")

    async def call(self, fn: Callable[[Store], T]) -> T:
        """``fn(store)`` in a worker thread, between the writer's own calls; OSError naming the
        problem when the store cannot be used (and the problem noted, as the writer notes it). Its
        words name no path or address: a client may read them (the log names where)."""
        if self.db is None:
            raise OSError("no usage database (TRIOSHED_USAGE=0)")
        async with self._lock:
            if not await self._open():
                raise OSError(f"the usage database {self.problem}")
            db = self.db
            try:
                return await trio.to_thread.run_sync(lambda: fn(db))
            except StoreError as exc:
                self._fault(exc)
                raise OSError(f"the usage database {self.problem}") from None

    def _recovered(self, what: str) -> None:
        if self.problem:
            log.warning("usage database %s can be used again (%s)", self.where, what)
            self.problem = ""

    def _fault(self, exc: BaseException) -> None:
        problem = describe(exc)
        if problem != self.problem:
            log.error(
                "usage database %s %s; serving continues, usage waits in memory (up to %d rows) and is written once it can be",
                self.where, problem, self.bound,
            )  # fmt: skip
            self.problem = problem
        if "locked" not in problem and "unreachable" not in problem and self.db is not None:
            self.db.close()  # opened afresh next time (the file may have been fixed or moved away)

    async def query(self, **filters: Any) -> list[dict[str, Any]]:
        """Rows of the store (see :meth:`SqlStore.query`), after writing what waits."""
        if self.db is None:
            return []
        await self.flush()
        return await self.call(lambda db: db.query(**filters))
