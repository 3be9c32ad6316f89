"""The requests on their way to a runner: the bounded channel they enter by, the waiting list
the planner reads, and how each one ends (a runner, an error, or its requester gone).

A request enters with :meth:`RequestQueue.submit_nowait`: the channel's buffer is the queue bound
(TRIOSHED_MAX_QUEUE), and past it the request gets QueueFull (503), counted and recorded as a
refusal. :meth:`RequestQueue.run` moves the requests into the waiting list
(:class:`~trioshed.core.queue.Waiting`, arrival order) a burst at a time and tells the scheduler
(``wake``), whose planner and fast paths read it. A request queued again (its runner died) skips
the channel and goes back to its place (:meth:`RequestQueue.add_in_order`).

A request ends once: :meth:`finish` hands it a runner or an error and sets its ``done``;
:meth:`withdraw` is its requester leaving (cancelled), which gives back a runner granted
meanwhile. At shutdown every queued request gets ShuttingDown (:meth:`fail_all`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import trio

from trioshed.core.admission import queue_full
from trioshed.core.queue import Waiting
from trioshed.core.views import can_serve
from trioshed.errors import QueueFull, ShuttingDown, TrioshedError
from trioshed.scheduler.events import EventHistory
from trioshed.scheduler.lifetime import Note
from trioshed.scheduler.request import Request
from trioshed.scheduler.runner import Runner


class RequestQueue:
    """The scheduler's queue. ``note``: log and record an event; ``release``: give a runner's
    slot back; ``wake``: a change for the planner."""

    def __init__(
        self,
        bound: int,
        *,
        events: EventHistory,
        note: Note,
        release: Callable[[Runner], None],
        wake: Callable[[], None],
    ) -> None:
        self.bound = bound
        # The buffer is the queue bound (TRIOSHED_MAX_QUEUE).
        self._send, self._recv = trio.open_memory_channel[Request](bound)
        self.waiting: Waiting[Request] = Waiting()
        self.rejected = 0  # requests turned away with QueueFull
        self._events = events
        self._note = note
        self._release = release
        self._wake = wake

    def __len__(self) -> int:
        """Requests queued: waiting, or still in the channel."""
        return len(self.waiting) + self.in_channel()

    def in_channel(self) -> int:
        """Requests submitted and not yet in the waiting list (of models not yet known to it)."""
        return self._send.statistics().current_buffer_used

    def submit_nowait(self, req: Request) -> None:
        """Queue a new request, or raise QueueFull (503) when the queue is full."""
        if not queue_full(len(self), self.bound):
            with suppress(trio.WouldBlock):
                self._send.send_nowait(req)
                return
        self.rejected += 1
        self._events.refused(req.model.name, QueueFull())
        raise QueueFull()

    async def run(self) -> None:
        """Move requests from the channel into the waiting list until the channel is closed."""
        async with self._recv:
            async for req in self._recv:
                self._add(req)
                # take the whole burst before the next pass (each receive() is a checkpoint)
                while True:
                    try:
                        self._add(self._recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                self._wake()

    def _add(self, req: Request) -> None:
        if not req.done.is_set():
            self.waiting.add(req)

    def add_in_order(self, req: Request) -> None:
        """Queue ``req`` (queued again: its id is older than most) in arrival order, now."""
        if not req.done.is_set():
            self.waiting.add_in_order(req)
        self._wake()

    def finish(self, req: Request, *, runner: Runner | None = None, error: TrioshedError | None = None) -> None:
        """``req`` is decided: it gets ``runner``, or ``error`` (once; later calls do nothing)."""
        if req.done.is_set():
            return
        self.waiting.remove(req)
        req.runner, req.error = runner, error
        req.done.set()

    def fail(self, req: Request, error: TrioshedError) -> None:
        """Answer ``req`` with a refusal (the planner's, or the context-shrink policy's)."""
        self._note("failed", req.model)
        self._events.refused(req.model.name, error)
        self.finish(req, error=error)

    def fail_waiters(self, runner: Runner, error: TrioshedError) -> None:
        """``runner``'s load failed: the requests it would have served fail with ``error``."""
        for req in list(self.waiting):
            if req.model.path == runner.model.path and can_serve(runner.view(), req.model, req.options):
                self.finish(req, error=error)

    def withdraw(self, req: Request) -> None:
        """The requester left (cancelled): leave the queue, or give back a lease granted meanwhile."""
        if self.waiting.remove(req):
            self._note("left queue", req.model)
        if req.runner is not None and req.error is None:
            self._release(req.runner)
        req.error = req.error or ShuttingDown()
        req.done.set()
        self._wake()

    def fail_all(self) -> None:
        """Shutdown: every queued request, in the channel or waiting, gets ShuttingDown (503)."""
        while True:
            try:
                req = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.finish(req, error=ShuttingDown())
        self._fail_waiting()

    def close(self) -> None:
        """No more requests (the scheduler stops): the channel is closed, and the waiting
        requests get ShuttingDown."""
        self._send.close()
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        for req in list(self.waiting):
            self.finish(req, error=ShuttingDown())
