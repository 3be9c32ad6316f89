"""The scheduler: requests in, leases on runners out.

Shape (Trio): ``run()`` owns a nursery holding every runner's lifetime task. Requests enter the
queue (:mod:`.queue`: a bounded channel, full: :class:`QueueFull`, HTTP 503). Every change (a
request arrives or leaves, a lease ends, a load completes or fails, a runner exits) marks the
state dirty; the loop then asks the pure planner (:func:`trioshed.core.sched.plan`) what to do and
performs it: dispatch, load, evict, fail.

Here: the loop, the way in (admit, wait, ping a runner idle a while) and the way out (release,
hand a freed slot over). The decisions are pure, in ``core/``: the plan, admission and keep-alive
(:mod:`~trioshed.core.admission`), the waiting list and its fast paths (:mod:`~trioshed.core.queue`),
the context-shrink policy (:mod:`~trioshed.core.shrink`, performed by :mod:`.resize`). Beside it:
a planning pass, the plan's actions performed (:mod:`.planning`), a request as held here (:mod:`.request`), the runners and their lives (:mod:`.lifetime`: load,
health, crash, VRAM recovery; they tell back through a few callbacks), the lease the edge holds
(:mod:`.lease`), the snapshot (:mod:`.stats`), the history of events (:mod:`.events`).

Cancellation: a request cancelled while queued leaves the waiting list at once; a lease whose
``async with`` exits (client gone, handler cancelled) is released synchronously.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import NoReturn

import trio
from trio_util import RepeatedEvent

from trioshed.core import adapters, admission, queue, sched
from trioshed.core.admission import Tenant
from trioshed.core.fairshare import FairShare
from trioshed.core.model import ModelSpec, Placement, RunnerOptions
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import RemoteDevices
from trioshed.errors import ShuttingDown, TrioshedError
from trioshed.keys import ANONYMOUS, ApiKey
from trioshed.models.gguf_meta import unreadable
from trioshed.scheduler.contracts import PromptFit
from trioshed.scheduler.events import EventHistory
from trioshed.scheduler.fit import fitted_lease
from trioshed.scheduler.lease import Lease
from trioshed.scheduler.lifetime import (
    HEALTH_INTERVAL,
    PING_IDLE,
    PING_RETRIES,
    Owner,
    Runners,
)
from trioshed.scheduler.planning import Limits, Planning
from trioshed.scheduler.queue import RequestQueue
from trioshed.scheduler.request import Request
from trioshed.scheduler.resize import Resizer
from trioshed.scheduler.runner import Estimator, Runner, RunnerFactory
from trioshed.scheduler.stats import RunnerStats, SchedulerStatistics, snapshot
from trioshed.trace import current as current_trace

__all__ = ["HEALTH_INTERVAL", "Lease", "RunnerStats", "Scheduler", "SchedulerStatistics"]

log = logging.getLogger(__name__)

# What _note records in the event history (the rest is only logged: dispatch, left queue, failed).
_EVENTS = frozenset({"load", "ready", "evict", "unloaded", "crashed", "load failed", "unhealthy"})


class Scheduler:
    """Owns the runners; hands out leases. Start with ``await nursery.start(scheduler.run)``."""

    def __init__(
        self,
        *,
        devices: DeviceSource,
        factory: RunnerFactory,
        estimator: Estimator,
        place: sched.Placer,
        max_queue: int = 512,
        max_extra_wait: float = 0.0,
        max_loaded_models: int = 0,
        default_keep_alive: float = 300.0,
        gpu_overhead: int = 0,
        spread: bool = False,
        record: list[tuple[str, str]] | None = None,
        remote: RemoteDevices | None = None,
    ) -> None:
        self._devices = devices
        self._remote = remote
        self._estimator = estimator
        self.max_queue = max_queue  # the queue's bound (TRIOSHED_MAX_QUEUE)
        self.max_extra_wait = max_extra_wait  # TRIOSHED_MAX_EXTRA_WAIT (0: arrival order)
        self.max_loaded = sched.default_max_loaded(max_loaded_models, len(devices.gpus))
        self.default_keep_alive = default_keep_alive
        self.record = record  # (event, model) in order: for tests and debugging
        # Loads, evictions, unloads, crashes and refusals as they happened, for readers to follow
        # (/metrics counts them by reason and times loads; a snapshot cannot hold every load).
        self.events = EventHistory()
        # Requests enter here, and wait (self._waiting, read by the planner and the fast paths).
        self._queue = RequestQueue(max_queue, events=self.events, note=self._note, release=self.release_slot, wake=self._wake)
        self._waiting = self._queue.waiting
        # The context-shrink policy's hands, on the waiting requests.
        self._resizer = Resizer(estimator, self._waiting, wake=self._wake, fail=self._queue.fail, record=record)
        # The runners and their lives; they tell this scheduler what happened through Owner.
        owner = Owner(note=self._note, wake=self._wake, out_of_memory=self._resizer.after_out_of_memory, fail_waiters=self._queue.fail_waiters)
        self._runners = Runners(owner, factory=factory, devices=devices, remote=remote)
        # A planning pass: the planner's actions performed on the parts above.
        self._planning = Planning(
            waiting=self._waiting, runners=self._runners, devices=devices, remote=remote, place=place,
            limits=Limits(self.max_loaded, gpu_overhead, spread, max_extra_wait), queue=self._queue,
            resizer=self._resizer, dispatch=self._dispatch, start_load=self._start_load, record=record,
        )  # fmt: skip
        self._changes = RepeatedEvent()  # set on every change a waiter cares about
        self._plan = RepeatedEvent()  # set on a change the planner has something to decide on
        self.changed_at = 0.0  # when the state last changed (Trio's clock; 0 before any change)
        self._dirty = False  # a change the planner must look at (others only wake waiters)
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._tenants: dict[str, Tenant] = {}  # by API key name ("" = no keys configured)
        self._fair = FairShare()  # the weighted fair order between them

    # -- the public surface -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; on the way out every runner is stopped and reaped."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._remote is not None:
                    self._remote.on_change = self._wake
                    await nursery.start(self._remote.run, self._runners.remote_busy)
                nursery.start_soon(self._queue.run)
                nursery.start_soon(self._wake_when_due)
                task_status.started()
                async with aclosing(self._plan.events()) as changes:
                    async for _ in changes:  # eventually consistent: bursts coalesce into one pass
                        if self._dirty:
                            self._dirty = False
                            self._schedule()
        finally:
            self._closing = True
            self._queue.close()

    @asynccontextmanager
    async def acquire(
        self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None = None, *,
        key: ApiKey = ANONYMOUS, floor: int = 0, fit: PromptFit | None = None,
    ) -> AsyncIterator[Lease]:
        """Wait for a runner of ``model`` with ``options`` and hold a slot on it.

        Raises QueueFull (503) at once when the queue is full; the planner's errors (507, 503
        cooldown, load failures) when they apply. Cancellation while waiting leaves the queue.
        ``key``: whose request (its limits, its share; the HTTP gate's key for a route).
        ``floor``: the smallest automatic ``num_ctx`` the request may be loaded at. A load that
        does not fit (the planner's 507) or runs out of memory is tried at the next smaller
        bucket, down to it (``trioshed.core.context.smaller_context``); the lease then says so
        (:attr:`Lease.shrunk`). 0: ``num_ctx`` was set, never lowered.
        ``fit``: the request's prompt is counted and fitted to the runner's context, its floor
        decided with it (:mod:`trioshed.scheduler.fit`): ContextTooLong (400) or
        ContextOutOfMemory (507) where it does not fit.
        """
        lease = await self.wait_for_lease(model, options, keep_alive, key=key, floor=floor, fit=fit)
        try:
            yield lease
        finally:
            lease.release()

    async def wait_for_lease(
        self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None, *,
        key: ApiKey = ANONYMOUS, floor: int = 0, fit: PromptFit | None = None,
    ) -> Lease:
        """A lease on a runner that answers: one idle for PING_IDLE or more is pinged first (the
        reference pings on every reuse); one that does not answer within PING_TIMEOUT is killed
        as hung and the request waits for its replacement (at most PING_RETRIES times).

        The lease can run the request again on a new runner if this one dies before it answers
        (:meth:`Lease.rerun`). ``key``, ``floor``, ``fit``: as :meth:`acquire`'s."""
        if fit is not None:
            lease = functools.partial(self._lease, model, keep_alive=keep_alive, key=key)
            return await fitted_lease(fit, model, options, self._ready_runner(model), lease)
        return await self._lease(model, options, floor, keep_alive=keep_alive, key=key)

    async def _lease(
        self, model: ModelSpec, options: RunnerOptions, floor: int, *, keep_alive: float | None, key: ApiKey
    ) -> Lease:
        req = self._admit(model, options, keep_alive, key)
        self._resizer.set_floor(req, floor)
        req, runner = await self._pinged(req)
        return Lease(self, runner, req.load_duration, req.key.name, req)

    async def wait_again(self, req: Request) -> tuple[Request, Runner]:
        """``req``'s runner died before it answered: wait for another, at the head of the queue.

        It was admitted once, so neither its key's limits nor the queue bound refuse it now."""
        return await self._pinged(req.again())

    async def _pinged(self, req: Request) -> tuple[Request, Runner]:
        """Wait for a runner for ``req``, pinging one that was idle (see :meth:`wait_for_lease`)."""
        for _ in range(PING_RETRIES):
            runner = await self._wait_for_runner(req)
            if req.idle_for < PING_IDLE:
                return req, runner
            try:
                if await self._runners.answers(runner):  # pinged (killed as hung if not)
                    return req, runner
            except BaseException:
                self.release_slot(runner, req.key.name)
                raise
            self.release_slot(runner, req.key.name)
            req = req.again()
        return req, await self._wait_for_runner(req)  # as it comes, unpinged

    def _admit(self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None, key: ApiKey) -> Request:
        """A new request of ``key``'s, if its concurrency limit and its model's file allow it."""
        if self._closing or self._nursery is None:
            raise ShuttingDown()
        tenant = self._tenants.setdefault(key.name, Tenant())
        if (refused := admission.concurrent_refusal(key, tenant)) is not None:
            self._refuse(model, refused)
        try:
            estimate = self._estimator(model, options)  # cached GGUF header read: microseconds once warm
        except (OSError, ValueError) as exc:
            raise unreadable(model.name, model.path, exc) from None
        own = adapters.own_only(model, embedding=options.embedding)  # an adapter group's smaller runner
        return Request(
            alone=functools.partial(self._estimator, own) if own is not None else None,
            id=next(self._ids),
            model=model,
            options=options,
            keep_alive=admission.keep_alive(keep_alive, self._pinned_for_session(model), self.default_keep_alive),
            estimate=estimate,
            key=key,
            share=self._fair.arrive(key.name, key.weight),
            queued_at=trio.current_time(),
        )

    async def _wait_for_runner(self, req: Request) -> Runner:
        """Dispatch ``req`` at once when a runner has a free slot and nothing waits ahead of it,
        else queue it and wait for the planner's decision (raised when it is an error).

        A request queued again (``req.again``) was admitted before: no limit or bound refuses it,
        and it goes back to its place in arrival order (ahead of those that came after it)."""
        if self._closing or self._nursery is None:
            raise ShuttingDown()
        trace, key = current_trace.get(), req.key
        tenant = self._tenants.setdefault(key.name, Tenant())
        runner = queue.free_runner(req, self._runners.values()) if self._nothing_ahead(req) else None
        if runner is not None:
            # Fast path, FIFO-safe because nothing for this model waits ahead of it: a ready
            # runner has a free slot (the planner would dispatch it at once too). Not a yield:
            # the request's next step, its send to the runner, is one.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._dispatch(req, runner)
            if trace is not None:
                trace.leased(req.model.name, 0.0, req.load_duration)
            tenant.leased += 1
            return runner
        if not req.again_of and (refused := admission.queued_refusal(key, tenant)) is not None:
            self._refuse(req.model, refused)
        tenant.queued += 1
        try:
            if req.again_of:
                self._queue.add_in_order(req)
            else:
                self.submit_nowait(req)
            try:
                await req.done.wait()
            except BaseException:
                self._queue.withdraw(req)
                raise
        finally:
            tenant.queued -= 1
        if req.error is not None:
            raise req.error
        assert req.runner is not None
        if trace is not None:
            trace.leased(req.model.name, trio.current_time() - req.queued_at, req.load_duration)
        tenant.leased += 1
        return req.runner

    def _refuse(self, model: ModelSpec, error: TrioshedError) -> NoReturn:
        self.events.refused(model.name, error)
        raise error

    def _nothing_ahead(self, req: Request) -> bool:
        """No request waits ahead of ``req`` that a runner of its model could serve
        (:func:`trioshed.core.queue.nothing_ahead`), nor any still in the channel (model unknown)."""
        if self._queue.in_channel():
            return False
        return queue.nothing_ahead(req, self._waiting, self._runners.values())

    def runner_models(self) -> list[ModelSpec]:
        """The model each runner was started from (a models.toml reload compares them)."""
        return [r.model for r in self._runners.values()]

    def _ready_runner(self, model: ModelSpec) -> Runner | None:
        """A ready runner of ``model``'s files, not leaving (None: none is up)."""
        return self._runners.ready_runner(model)

    def close_queue(self) -> None:
        """Shutdown: fail every queued request with ShuttingDown (503); leases held go on."""
        self._closing = True
        self._queue.fail_all()
        self._wake()

    def submit_nowait(self, req: Request) -> None:
        """Queue a new request, or raise QueueFull (503) when the queue is full."""
        self._queue.submit_nowait(req)

    async def unload(self, model: ModelSpec) -> bool:
        """Unload every runner of ``model`` (``keep_alive: 0`` with an empty prompt). Returns
        whether one was loaded; waits until the children have exited."""
        runners = self._runners.unload(model)
        while any(r.id in self._runners for r in runners):
            await self.wait_changed()
        return bool(runners)

    def pin(self, model: ModelSpec, pinned: bool) -> bool:
        """Pin or unpin ``model`` until trioshed restarts, over what models.toml says. A pinned
        model is never evicted to make room and stays loaded (keep-alive forever) unless a
        request's own ``keep_alive`` says otherwise, as ``pinned = true`` in models.toml; unpinned,
        its keep-alive counts down from now. Returns whether a runner of it is loaded now."""
        log.info("%s %s until trioshed restarts", "pinned" if pinned else "unpinned", model.name)
        return bool(self._runners.pin(model, pinned, self.default_keep_alive))

    def _pinned_for_session(self, model: ModelSpec) -> ModelSpec:
        """``model`` as pin() left it: pinned (keep-alive forever unless set), or unpinned."""
        return self._runners.pinned_for_session(model)

    async def wait_changed(self) -> None:
        """Wait for the next change of state (a request queued or leased, a lease ended, a runner
        loaded, unloaded, crashed...); then read ``statistics()`` or ``events``."""
        await self._changes.wait()

    def evict_after_leases(self, runner: Runner, reason: str) -> None:
        """Replace ``runner`` once its leases end (it misbehaved under one: hung)."""
        self._runners.evict_after_leases(runner, reason)

    async def wait_statistics(self, predicate: Callable[[SchedulerStatistics], bool]) -> SchedulerStatistics:
        """Wait until ``predicate(statistics())`` holds (checked after every change); return it."""
        while True:
            stats = self.statistics()
            if predicate(stats):
                return stats
            await self.wait_changed()

    @property
    def devices(self) -> DeviceSource:
        return self._devices

    def statistics(self) -> SchedulerStatistics:
        return snapshot(
            self._runners.values(), self._waiting, queued=len(self._queue), tenants=self._tenants,
            counters={**self._planning.counters, **self._runners.counters, "rejected": self._queue.rejected}, remote=self._remote,
            now=trio.current_time(), wall=time.time(),
        )  # fmt: skip

    # -- internals ----------------------------------------------------------------------------

    def _wake(self) -> None:
        """A change: waiters look again; the planner runs a pass unless it has nothing to do."""
        self._dirty = True
        self.changed_at = trio.current_time()
        self._changes.set()
        if self._waiting or self._planning.holding() or self._queue.in_channel() or self._runners.any_closed():
            self._plan.set()

    def _note(self, event: str, model: ModelSpec, reason: str = "", seconds: float = 0.0) -> None:
        log.log(logging.DEBUG if event == "dispatch" else logging.INFO, "%s %s", event, model.name)
        if self.record is not None:
            self.record.append((event, model.short_name))
        if event in _EVENTS:
            self.events.add(event, model.name, reason, seconds)

    async def _wake_when_due(self) -> None:
        """Plan again when a held request becomes due (nothing else may change meanwhile)."""
        while True:
            with self._planning.hold_timer:
                await trio.sleep_forever()
            self._planning.hold_timer = trio.CancelScope()
            self._wake()

    def release_slot(self, runner: Runner, tenant: str | None = None) -> None:
        if tenant is not None:
            self._tenants[tenant].leased -= 1
        runner.leases -= 1
        runner.last_used = trio.current_time()
        if self._hand_over(runner):
            return  # the dispatch told the waiters; nothing new for the planner
        self._runners.released(runner)
        self._wake()

    def _hand_over(self, runner: Runner) -> bool:
        """Give a slot just freed straight to the oldest request waiting for this runner's model,
        when the planner would (:func:`trioshed.core.queue.hand_over`), without a planning pass
        over the whole queue. Nothing else changes (the runner stays leased): no pass is needed."""
        if runner.id not in self._runners:
            return False
        oldest = queue.hand_over(runner, self._waiting, (t.queued for t in self._tenants.values()))
        if oldest is None:
            return False
        self._dispatch(oldest, runner)
        return True

    def _schedule(self) -> None:
        """One planning pass (:mod:`.planning`)."""
        if self._planning.run():
            self._changes.set()  # a load, an eviction or a refusal begun: waiters look again

    def _dispatch(self, req: Request, runner: Runner) -> None:
        now = trio.current_time()
        req.idle_for = now - runner.last_used if runner.leases == 0 and runner.served > 0 else 0.0
        req.load_duration = runner.load_duration if runner.served == 0 else 0.0
        runner.lease(req.keep_alive, now, req.model)
        self._fair.dispatched(req.share)
        self._note("dispatch", req.model)
        self._queue.finish(req, runner=runner)
        self.changed_at = now
        self._changes.set()  # leased: waiters look again

    def _start_load(self, req: Request, placement: Placement, model: ModelSpec | None = None) -> Runner:
        """Start a runner for ``req`` (``model``: the runner the plan chose, one of its model's
        own adapters only; else the one its model gives)."""
        assert self._nursery is not None
        estimate = req.alone(req.options) if model is not None and req.alone is not None else req.estimate
        runner = self._runners.start(
            next(self._ids), req.model, req.options, placement, estimate, keep_alive=req.keep_alive,
            runner_nursery=self._nursery, runner=model,
        )  # fmt: skip
        log.info(
            "loading %s: context %d tokens per slot x %d slot(s), batch %d", req.model.name,
            req.options.num_ctx, req.options.num_parallel, req.options.num_batch,
        )  # fmt: skip
        return runner

    async def wait_resized(self, req: Request, num_ctx: int) -> tuple[Request, Runner]:
        """``req`` was served by a runner made smaller than it asked (``Lease.regrow``): wait for
        one at ``num_ctx``, the bucket of its exact count, never smaller."""
        return await self._pinged(self._resizer.resized(req, num_ctx))
