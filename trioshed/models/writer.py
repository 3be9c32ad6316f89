"""The one writer of trioshed's Ollama-layout store (``pulled/``): who may change its manifests
and delete its blobs, and how a long store operation's progress reaches a client.

* **One lock.** Every manifest written (pull, create, copy) and every blob deleted (delete, a
  create replacing a model, a failed create) happens under :attr:`StoreWriter.lock`, held by the
  task doing it, never across a ``yield``.
* **Claims.** A pull or push runs for minutes without the lock; instead it *claims* the blobs it
  relies on (:meth:`StoreWriter.claim`, taken under the lock, so that a deletion in progress has
  finished and a later one sees it). A deletion never removes a claimed blob, so a delete racing
  a pull (or push) of another model that shares a blob cannot leave that model's manifest naming
  a missing blob.
* **Progress from a task, over a channel.** :meth:`StoreWriter.start` runs a store operation
  (``produce(report)``) as a task of the writer's own nursery (owned by ``serve()``); its
  progress lines go to the client through an unbuffered memory channel (:class:`Lines`), so the
  operation goes at the client's pace. The consumer closes :class:`Lines` (``async with``): the
  operation is cancelled in its own task, where its locks, files and clean-up live. Closing is
  synchronous, so even a consumer finalised by the garbage collector in another task releases
  nothing it does not own.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

T = TypeVar("T")
log = logging.getLogger(__name__)
Line = dict[str, Any]
#: How an operation reports a progress line: waits until the client took it.
Report = Callable[[Line], Awaitable[None]]


class _Failed:
    """The operation's error, carried to the consumer (raised there)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class Lines:
    """A store operation's progress lines, as an async iterator; its error is raised at the end.
    Close it (``async with``, :meth:`close`): the operation is cancelled if it is still running."""

    def __init__(self, receive: trio.MemoryReceiveChannel[Line | _Failed]) -> None:
        self._receive = receive
        self.scope = trio.CancelScope()
        self.closed = False

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> Line:
        try:
            item = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Synchronous and idempotent: safe from any task, at any time."""
        self.closed = True
        self._receive.close()
        self.scope.cancel(reason="the client left")

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Lines:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class StoreWriter:
    """See the module docstring. One per server; :meth:`run` is its long-lived task."""

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self._claims: Counter[str] = Counter()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery the operations run in, until cancelled (which cancels them)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def start(self, produce: Callable[[Report], Awaitable[None]]) -> Lines:
        """Run ``produce(report)`` as a task of the writer; its lines come out of the returned
        :class:`Lines`. The task inherits the caller's context (its API key, its trace)."""
        if self._nursery is None:
            raise RuntimeError("the store writer is not running")
        # unbuffered: an operation goes no faster than its client reads its progress
        send, receive = trio.open_memory_channel[Line | _Failed](0)
        lines = Lines(receive)
        self._nursery.start_soon(_operate, produce, send, lines)
        return lines

    @asynccontextmanager
    async def claim(self, names: Iterable[str]) -> AsyncIterator[None]:
        """Keep the blobs ``names`` (file names, ``sha256-<hex>``) from deletion until the end of
        the block. Taken under the lock: a deletion in progress finishes first."""
        names = list(names)
        async with self.lock:
            self._claims.update(names)
        try:
            yield
        finally:
            self._claims.subtract(names)
            self._claims = +self._claims  # drop the zeros

    def claimed(self) -> frozenset[str]:
        return frozenset(self._claims)

    async def change(self, fn: Callable[[frozenset[str]], T]) -> T:
        """Run the blocking store change ``fn(claimed)`` in a worker thread under the lock;
        ``claimed`` are the blob file names it must not delete."""
        async with self.lock:
            claimed = self.claimed()
            return await trio.to_thread.run_sync(fn, claimed)


async def _operate(produce: Callable[[Report], Awaitable[None]], send: trio.MemorySendChannel[Line | _Failed], lines: Lines) -> None:
    """One operation, in the writer's nursery: its error goes to its consumer, never into the
    nursery (which would end every other operation)."""
    with send, lines.scope:
        try:
            await produce(send.send)
        except Exception as exc:
            if lines.closed:  # the client left: the send that raised, or the error nobody reads
                if not isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
                    log.warning("a store operation whose client left failed: %s", exc)
                return
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await send.send(_Failed(exc))


@asynccontextmanager
async def open_store_writer() -> AsyncIterator[StoreWriter]:
    """A running :class:`StoreWriter`, for a command without a server and for tests."""
    writer = StoreWriter()
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        yield writer
        nursery.cancel_scope.cancel(reason="store writer closed")
