"""A request's hold on a runner slot: what the HTTP edge gets from the scheduler.

No request is lost to a runner's death. When the runner of a lease dies, hangs, is killed for
hanging, or sends nothing for TRIOSHED_STREAM_IDLE_TIMEOUT before it produced any of the
request's answer, the request is queued again and served by a new runner (:meth:`Lease.rerun`,
driven by :mod:`trioshed.api.pipeline.upstream` for every route, and by the count of a prompt,
:mod:`trioshed.scheduler.fit`): once; a runner of the same model that fails again on the same
request ends it with an error that names both failures.

A death is an event, never a timing: after a broken connection :meth:`Lease.death` waits for
the child's exit (briefly: a connection can break without one) and then for the runner's
lifetime task to record the crash (``Runner.gone``), however late a starved event loop runs it;
a runner whose child exited is never handed to a request meanwhile (``Runner.free_slot``). "Produced any of its answer" means precisely: a byte of the answer's body was
handed on towards the client (a piece of a stream given to the route, or a whole answer
returned). The request itself may have reached the dead runner: running it again is safe
because nothing of the first run was seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import trio

from trioshed.core.adapters import lora_field
from trioshed.core.context import Shrunk
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import RunnerCrashed, RunnerError
from trioshed.scheduler.contracts import RunnerHandle
from trioshed.scheduler.runner import Runner

#: Seconds a broken connection waits for the child's exit before it is taken as no death (the
#: exit is an event; this bounds only the case where the child lives on).
EXIT_GRACE = 2.0


class QueuedRequest(Protocol):
    """What a lease reads of the scheduler's record of its request."""

    @property
    def load_duration(self) -> float: ...
    @property
    def shrunk(self) -> Shrunk | None: ...
    @property
    def model(self) -> ModelSpec: ...


class LeaseOwner(Protocol):
    """What a lease needs of the scheduler that granted it. ``request`` is the owner's own
    record of the request, handed back to it as it was handed out."""

    def release_slot(self, runner: Runner, tenant: str | None = None) -> None:
        """Give back one slot on ``runner`` (and ``tenant``'s count of leases)."""
        ...
    def evict_after_leases(self, runner: Runner, reason: str) -> None: ...
    async def wait_again(self, request: Any) -> tuple[QueuedRequest, Runner]:
        """Queue ``request`` again (its runner died): the request and its new runner."""
        ...
    async def wait_resized(self, request: Any, num_ctx: int) -> tuple[QueuedRequest, Runner]:
        """Queue ``request`` again for a runner at ``num_ctx``: the request and that runner."""
        ...


class Lease:
    """A request's hold on a runner slot, from dispatch until released (synchronous, idempotent).

    Implements :class:`trioshed.scheduler.contracts.LeaseView`, what the routes see of it."""

    def __init__(self, owner: LeaseOwner, runner: Runner, load_duration: float, tenant: str, request: QueuedRequest) -> None:
        self._scheduler = owner
        self._runner = runner
        self._tenant = tenant  # the API key's name: its slot is counted until released
        self._request = request  # the scheduler's record of the request (queued again by rerun)
        self.load_duration = load_duration
        self.released = False
        #: The failure (a death, or a stall) that made this request run again on a new runner
        #: (None: it has not).
        self.rerun_after: RunnerError | None = None

    @property
    def model(self) -> ModelSpec:
        return self._runner.model

    @property
    def options(self) -> RunnerOptions:
        return self._runner.options

    @property
    def member(self) -> ModelSpec:
        """The model the request named (on an adapter group's runner, one of its members)."""
        return self._request.model

    @property
    def lora(self) -> list[dict[str, object]] | None:
        """The request's ``lora`` list on this runner (:func:`trioshed.core.adapters.lora_field`;
        worked out for the runner it holds now, which a rerun may change)."""
        return lora_field(self._runner.model, self._request.model)

    @property
    def shrunk(self) -> Shrunk | None:
        """Where the request's automatic context was made smaller to fit the memory, and why
        (None: it got the size it asked for)."""
        return self._request.shrunk

    @property
    def handle(self) -> RunnerHandle:
        """The runner's child (a lease is granted on a ready runner only: it has one)."""
        handle = self._runner.handle
        if handle is None:
            raise RuntimeError(f"lease on runner {self._runner.id} of '{self.model.name}', which has no child")
        return handle

    @property
    def base_url(self) -> str:
        return self.handle.base_url

    @property
    def crash(self) -> RunnerCrashed | None:
        """Set when the runner died under this lease: the error to give the client."""
        return self._runner.crash

    async def death(self) -> RunnerCrashed | None:
        """After the connection to the runner broke: its crash, if its child died (None: it lives
        on). Waits up to EXIT_GRACE for the child's exit, then for the runner's lifetime task to
        record the crash (an event; a runner on RPC servers is reported once they are checked,
        bounded), so that running the request again never meets the dead runner."""
        handle = self.handle
        if self.crash is None and not handle.exited:
            with trio.move_on_after(EXIT_GRACE):
                await handle.wait_exited()
            if not handle.exited:
                return None
        runner = self._runner
        await runner.gone.wait()
        return runner.crash or RunnerCrashed(self.model.name, handle.returncode)

    def produced(self) -> None:
        """The runner sent a piece of an answer: a sign of life for its health monitor."""
        self._runner.progress += 1

    def evict(self, reason: str) -> None:
        """The runner misbehaved under this lease (hung): replace it once its leases end."""
        self._scheduler.evict_after_leases(self._runner, reason)

    @contextmanager
    def waiting_for_answer(self) -> Iterator[None]:
        """Around a request sent to the runner until the first byte of its answer: meanwhile the
        runner is asked every few seconds (PING_TIMEOUT) whether it still answers, and killed as
        hung when it does not, so that the request runs again on a new one. (A ping before
        reuse cannot close that gap: a child can stop just after answering it; measured, a
        llama-server whose threads were busy still answered /health just after SIGSTOP.)"""
        runner = self._runner
        runner.waiting_for_answer()
        try:
            yield
        finally:
            runner.answered()

    async def rerun(self, crash: RunnerError) -> None:
        """The runner died, was killed as hung, or stalled (RunnerStalled) before it produced any
        of this request's answer: mark it leaving, give its slot back and wait, at the head of
        its model's queue, for a slot on a new runner; the lease then stands for that one. Once
        per request: a second failure raises an error naming both (the caller's request ends
        with it).

        Raises ``crash`` itself when the request cannot run again (released), and whatever
        waiting for a runner raises (a failed load, shutdown, a 507).
        Cancellation: while waiting, the request leaves the queue; the lease is then released.
        """
        if self.released:
            raise crash
        if self.rerun_after is not None:
            raise RunnerCrashed.again(self.model.name, self.rerun_after, crash)
        self.rerun_after = crash
        self._runner.leave("a request it failed runs again on a new runner")
        self._give_back()
        try:
            self._request, self._runner = await self._scheduler.wait_again(self._request)
        except BaseException:
            self.released = True  # its slot went back above; nothing is held now
            raise
        self.load_duration += self._request.load_duration

    async def regrow(self, num_ctx: int) -> None:
        """The runner's context was made smaller than the request asked (:attr:`shrunk`) and
        does not hold it: give its slot back and wait for a runner at ``num_ctx`` (the bucket
        of its exact count), as any request would; the lease then stands for that one. Before
        any of the answer was asked for. Raises what waiting for a runner raises (a 507 where
        that size does not fit). Cancellation: while waiting, the request leaves the queue; the
        lease is then released."""
        if self.released:
            raise RuntimeError("regrow of a released lease")
        self._give_back()
        try:
            self._request, self._runner = await self._scheduler.wait_resized(self._request, num_ctx)
        except BaseException:
            self.released = True  # its slot went back above; nothing is held now
            raise
        self.load_duration += self._request.load_duration

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._give_back()

    def _give_back(self) -> None:
        """The slot back to the scheduler, and the request's model's hold on the runner."""
        self._runner.member_released(self._request.model.name, trio.current_time())
        self._scheduler.release_slot(self._runner, self._tenant)
