"""The scheduler: requests in, leases on runners out.

Shape (Trio): ``run()`` owns a nursery holding every runner's lifetime task. Requests enter
through a bounded memory channel (full: :class:`QueueFull`, HTTP 503); a receiver task moves them
into the waiting list. Every change (a request arrives or leaves, a lease ends, a load completes
or fails, a runner exits) marks the state dirty; the loop then asks the pure planner
(:func:`trioshed.core.sched.plan`) what to do and performs it: dispatch, load, evict, fail.

The rest, one topic a module: a runner's fields and scopes (:mod:`.runner`) and its lifetime
(:mod:`.lifetime`: load, health, crash, VRAM recovery), the lease the edge holds (:mod:`.lease`),
the frozen snapshot (:mod:`.stats`) and the history of events readers follow (:mod:`.events`).

Cancellation: a request cancelled while queued leaves the waiting list at once; a lease whose
``async with`` exits (client gone, handler cancelled) is released synchronously.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import NoReturn

import trio
from trio_util import RepeatedEvent

from trioshed.core import sched
from trioshed.core.context import Shrunk, out_of_memory, smaller_context
from trioshed.core.model import MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.sched import Dispatch, Evict, Fail, Load, Machine, RunnerState
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import RemoteDevices
from trioshed.errors import (
    InsufficientMemory,
    LoadFailed,
    LoadOutOfMemory,
    QueueFull,
    ShuttingDown,
    SmallerContextPreferred,
    TooManyRequests,
    TrioshedError,
)
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
    PING_TIMEOUT,
    RunnerLifetimes,
)
from trioshed.scheduler.runner import Estimator, Runner, RunnerFactory
from trioshed.scheduler.stats import (
    QueueStats,
    RunnerStats,
    SchedulerStatistics,
    TenantStats,
    runner_stats,
)
from trioshed.trace import current as current_trace

__all__ = ["HEALTH_INTERVAL", "Lease", "RunnerStats", "Scheduler", "SchedulerStatistics"]

log = logging.getLogger(__name__)

# What _note records in the event history (the rest is only logged: dispatch, left queue, failed).
_EVENTS = frozenset({"load", "ready", "evict", "unloaded", "crashed", "load failed", "unhealthy"})


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _keep_alive(requested: float | None, model: ModelSpec, default: float) -> float:
    """The request's own keep-alive, else the model's (models.toml), else TRIOSHED_KEEP_ALIVE."""
    if requested is not None:
        return requested
    return default if model.keep_alive is None else model.keep_alive


@dataclass
class _Tenant:
    """An API key's requests in the scheduler now (its limits count these)."""

    queued: int = 0
    leased: int = 0


@dataclass(eq=False)
class _Request:
    id: int
    model: ModelSpec
    options: RunnerOptions
    keep_alive: float
    estimate: MemoryEstimate
    done: trio.Event = field(default_factory=trio.Event)
    runner: Runner | None = None
    error: TrioshedError | None = None
    load_duration: float = 0.0
    idle_for: float = 0.0  # how long the runner it was handed had been idle (0: busy or fresh)
    room_wait: str = ""  # why it waits for memory, as last logged ("" = it has not)
    arrived: float = field(default_factory=time.time)  # wall clock: the status page's oldest wait
    held_since: float | None = None  # when its swap was first held for another model's queue
    key: ApiKey = ANONYMOUS  # whose request: its tenant and weight
    share: float = 0.0  # its start tag in the fair order between tenants
    queued_at: float = 0.0  # Trio's clock: when it reached the scheduler (priority ages from it)
    retries: int = 0  # how many times it was queued again (its runner died or failed its ping)
    floor: int = 0  # the smallest automatic num_ctx it may be loaded at (0: num_ctx set, never lowered)
    floor_estimate: MemoryEstimate | None = None  # its estimate at that size
    shrunk: Shrunk | None = None  # where its automatic context was made smaller, and why

    @functools.cached_property
    def view(self) -> sched.RequestView:
        return sched.RequestView(
            self.id, self.model, self.options, self.estimate, priority=self.model.priority,
            held_since=self.held_since, tenant=self.key.name, share=self.share, arrived=self.queued_at,
            floor_estimate=self.floor_estimate if self.options.num_ctx > self.floor else None,
        )  # fmt: skip

    @property
    def again_of(self) -> bool:
        """Whether this is a request queued again (its runner died, or failed its ping)."""
        return self.retries > 0

    def again(self) -> _Request:
        """This request, to be queued again: the same id, arrival and share; nothing decided."""
        return _Request(
            self.id, self.model, self.options, self.keep_alive, self.estimate, arrived=self.arrived,
            held_since=self.held_since, key=self.key, share=self.share, queued_at=self.queued_at,
            retries=self.retries + 1, floor=self.floor, floor_estimate=self.floor_estimate, shrunk=self.shrunk,
        )  # fmt: skip

    def held(self, now: float) -> None:
        if self.held_since is None:
            self.held_since = now
            self.__dict__.pop("view", None)  # the cached view carries it


class Scheduler(RunnerLifetimes):
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
        self._factory = factory
        self._estimator = estimator
        self._place = place
        self.max_queue = max_queue
        self.max_extra_wait = max_extra_wait  # TRIOSHED_MAX_EXTRA_WAIT (0: arrival order)
        self._hold_timer = trio.CancelScope()  # its deadline: when a held request becomes due
        self.max_loaded = sched.default_max_loaded(max_loaded_models, len(devices.gpus))
        self.default_keep_alive = default_keep_alive
        self._overhead = gpu_overhead
        self._spread = spread
        self.record = record  # (event, model) in order: for tests and debugging
        # Loads, evictions, unloads, crashes and refusals as they happened, for readers to follow
        # (/metrics counts them by reason and times loads; a snapshot cannot hold every load).
        self.events = EventHistory()
        # Requests enter here; the buffer is the queue bound (TRIOSHED_MAX_QUEUE).
        self._pending_send, self._pending_recv = trio.open_memory_channel[_Request](max_queue)
        self._waiting: dict[int, _Request] = {}  # arrival order
        self._waiting_by_path: dict[str, dict[int, _Request]] = {}  # the same, per model file
        self._runners: dict[int, Runner] = {}
        self._cooldowns: dict[str, tuple[float, str]] = {}
        self._backoff: dict[str, float] = {}
        self._killed_loading: set[str] = set()  # see RunnerLifetimes._on_killed_loading
        self._changes = RepeatedEvent()  # set on every change the planner or a waiter cares about
        self._session_pins: dict[str, bool] = {}  # model path -> pinned, set by pin() until restart
        self._dirty = False  # a change the planner must look at (others only wake waiters)
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._tenants: dict[str, _Tenant] = {}  # by API key name ("" = no keys configured)
        self._fair = sched.FairShare()  # the weighted fair order between them
        self._counters = dict(loads=0, unloads=0, crashes=0, load_failures=0, rejected=0, room_waits=0, passes=0)

    # -- the public surface -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; on the way out every runner is stopped and reaped."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._remote is not None:
                    self._remote.on_change = self._wake
                    await nursery.start(self._remote.run, self._remote_busy)
                nursery.start_soon(self._receive_requests)
                nursery.start_soon(self._wake_when_due)
                task_status.started()
                async with aclosing(self._changes.events()) as changes:
                    async for _ in changes:  # eventually consistent: bursts coalesce into one pass
                        if self._dirty:
                            self._dirty = False
                            self._schedule()
        finally:
            self._closing = True
            self._pending_send.close()
            for req in list(self._waiting.values()):
                self._finish(req, error=ShuttingDown())

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
        self._set_floor(req, floor)
        req, runner = await self._pinged(req)
        return Lease(self, runner, req.load_duration, req.key.name, req)

    async def wait_again(self, req: _Request) -> tuple[_Request, Runner]:
        """``req``'s runner died before it answered: wait for another, at the head of the queue.

        It was admitted once, so neither its key's limits nor the queue bound refuse it now."""
        return await self._pinged(req.again())

    async def _pinged(self, req: _Request) -> tuple[_Request, Runner]:
        """Wait for a runner for ``req``, pinging one that was idle (see :meth:`wait_for_lease`)."""
        for _ in range(PING_RETRIES):
            runner = await self._wait_for_runner(req)
            if req.idle_for < PING_IDLE:
                return req, runner
            try:
                with trio.move_on_after(PING_TIMEOUT):
                    if runner.handle is not None and await runner.handle.health():
                        return req, runner
            except BaseException:
                self.release_slot(runner, req.key.name)
                raise
            self._declare_hung(runner, f"did not answer a health check within {PING_TIMEOUT:g}s before reuse")
            self.release_slot(runner, req.key.name)
            req = req.again()
        return req, await self._wait_for_runner(req)  # as it comes, unpinged

    def _admit(self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None, key: ApiKey) -> _Request:
        """A new request of ``key``'s, if its concurrency limit and its model's file allow it."""
        if self._closing or self._nursery is None:
            raise ShuttingDown()
        tenant = self._tenants.setdefault(key.name, _Tenant())
        if key.max_concurrent and tenant.queued + tenant.leased >= key.max_concurrent:
            self._refuse(model, TooManyRequests(key.name, "concurrent requests", key.max_concurrent))
        try:
            estimate = self._estimator(model, options)  # cached GGUF header read: microseconds once warm
        except (OSError, ValueError) as exc:
            raise unreadable(model.name, model.path, exc) from None
        return _Request(
            id=next(self._ids),
            model=model,
            options=options,
            keep_alive=_keep_alive(keep_alive, self._pinned_for_session(model), self.default_keep_alive),
            estimate=estimate,
            key=key,
            share=self._fair.arrive(key.name, key.weight),
            queued_at=trio.current_time(),
        )

    async def _wait_for_runner(self, req: _Request) -> Runner:
        """Dispatch ``req`` at once when a runner has a free slot and nothing waits ahead of it,
        else queue it and wait for the planner's decision (raised when it is an error).

        A request queued again (``req.again``) was admitted before: no limit or bound refuses it,
        and it goes back to its place in arrival order (ahead of those that came after it)."""
        if self._closing or self._nursery is None:
            raise ShuttingDown()
        trace, key = current_trace.get(), req.key
        tenant = self._tenants.setdefault(key.name, _Tenant())
        runner = self._free_slot_now(req) if self._nothing_ahead(req) else None
        if runner is not None:
            # Fast path, FIFO-safe because nothing for this model waits ahead of it: a ready
            # runner has a free slot (the planner would dispatch it at once too).
            await trio.lowlevel.checkpoint_if_cancelled()
            self._dispatch(req, runner)
            await trio.lowlevel.cancel_shielded_checkpoint()
            if trace is not None:
                trace.leased(req.model.name, 0.0, req.load_duration)
            tenant.leased += 1
            return runner
        if not req.again_of and key.max_queued and tenant.queued >= key.max_queued:
            self._refuse(req.model, TooManyRequests(key.name, "queued requests", key.max_queued))
        tenant.queued += 1
        try:
            if req.again_of:
                self._enqueue_in_order(req)
            else:
                self.submit_nowait(req)
            try:
                await req.done.wait()
            except BaseException:
                self._withdraw(req)
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

    def _nothing_ahead(self, req: _Request) -> bool:
        """No request for ``req``'s model waits that a runner of it could serve (one waiting for a
        reload, e.g. a larger context, does not hold back a request that fits the runner now; the
        runner's ``closed_from`` still bounds how long the swap waits), nor any request still in
        the channel (of unknown model)."""
        if self._pending_send.statistics().current_buffer_used:
            return False
        waiting = self._waiting_by_path.get(req.model.path)
        if not waiting:
            return True
        runners = [r for r in self._runners.values() if r.model.path == req.model.path]
        return not any(sched.can_serve(r.view(), w.model, w.options) for w in waiting.values() for r in runners)

    def _queued_count(self) -> int:
        return len(self._waiting) + self._pending_send.statistics().current_buffer_used

    def _free_slot_now(self, req: _Request) -> Runner | None:
        for runner in self._runners.values():
            if (
                runner.model.path == req.model.path
                and runner.free_slot
                and req.id < runner.closed_from
                and sched.can_serve(runner.view(), req.model, req.options)
            ):
                return runner
        return None

    def runner_models(self) -> list[ModelSpec]:
        """The model each runner was started from (a models.toml reload compares them)."""
        return [r.model for r in self._runners.values()]

    def _ready_runner(self, model: ModelSpec) -> Runner | None:
        """A ready runner of ``model``'s files, not leaving (None: none is up)."""
        for r in self._runners.values():
            if r.state is RunnerState.READY and not r.stopping and not r.evicting and sched.same_files(r.model, model):
                return r
        return None

    def close_queue(self) -> None:
        """Shutdown: fail every queued request with ShuttingDown (503); leases held go on."""
        self._closing = True
        while True:
            try:
                req = self._pending_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._finish(req, error=ShuttingDown())
        for req in list(self._waiting.values()):
            self._finish(req, error=ShuttingDown())
        self._wake()

    def submit_nowait(self, req: _Request) -> None:
        if self._queued_count() >= self.max_queue:
            self._counters["rejected"] += 1
            self.events.refused(req.model.name, QueueFull())
            raise QueueFull()
        try:
            self._pending_send.send_nowait(req)
        except trio.WouldBlock:
            self._counters["rejected"] += 1
            self.events.refused(req.model.name, QueueFull())
            raise QueueFull() from None

    async def unload(self, model: ModelSpec) -> bool:
        """Unload every runner of ``model`` (``keep_alive: 0`` with an empty prompt). Returns
        whether one was loaded; waits until the children have exited."""
        runners = [r for r in self._runners.values() if r.model.path == model.path]
        for r in runners:
            r.evicting = True
            r.unload_reason = "unload requested"
            if r.leases == 0:
                r.stop("unload requested")
        self._wake()
        while any(r.id in self._runners for r in runners):
            await self._wait_changed()
        return bool(runners)

    def pin(self, model: ModelSpec, pinned: bool) -> bool:
        """Pin or unpin ``model`` until trioshed restarts, over what models.toml says. A pinned
        model is never evicted to make room and stays loaded (keep-alive forever) unless a
        request's own ``keep_alive`` says otherwise, as ``pinned = true`` in models.toml; unpinned,
        its keep-alive counts down from now. Returns whether a runner of it is loaded now."""
        self._session_pins[model.path] = pinned
        log.info("%s %s until trioshed restarts", "pinned" if pinned else "unpinned", model.name)
        runners = [r for r in self._runners.values() if r.model.path == model.path and not r.stopping]
        for r in runners:
            r.pinned = pinned
            r.keep_alive = _keep_alive(None, self._pinned_for_session(r.model), self.default_keep_alive)
            if r.leases == 0 and r.state is RunnerState.READY:
                r.timer.deadline = trio.current_time() + r.keep_alive
        self._wake()
        return bool(runners)

    def _pinned_for_session(self, model: ModelSpec) -> ModelSpec:
        """``model`` as pin() left it: pinned (keep-alive forever unless set), or unpinned."""
        pinned = self._session_pins.get(model.path)
        if pinned is None or pinned == model.pinned:
            return model
        if pinned:
            return replace(model, pinned=True, keep_alive=math.inf if model.keep_alive is None else model.keep_alive)
        return replace(model, pinned=False, keep_alive=None if model.keep_alive == math.inf else model.keep_alive)

    async def wait_changed(self) -> None:
        """Wait for the next change of state (a request queued or leased, a lease ended, a runner
        loaded, unloaded, crashed...); then read ``statistics()`` or ``events``."""
        await self._changes.wait()

    def evict_after_leases(self, runner: Runner, reason: str) -> None:
        """Replace ``runner`` once its leases end (it misbehaved under one: hung)."""
        if not runner.evicting:
            runner.evicting = True
            runner.unload_reason = reason
            self._note("evict", runner.model, reason)
            self._wake()

    async def wait_statistics(self, predicate: Callable[[SchedulerStatistics], bool]) -> SchedulerStatistics:
        """Wait until ``predicate(statistics())`` holds (checked after every change); return it."""
        while True:
            stats = self.statistics()
            if predicate(stats):
                return stats
            await self._wait_changed()

    @property
    def devices(self) -> DeviceSource:
        return self._devices

    def statistics(self) -> SchedulerStatistics:
        now, wall = trio.current_time(), time.time()
        runners = [
            runner_stats(r, waiting=len(self._waiting_by_path.get(r.model.path, ())), now=now, wall=wall)
            for r in self._runners.values()
        ]
        states = [r.view().state for r in self._runners.values()]
        remote_usage = {
            dev.removeprefix("rpc:"): (r.model.name, b)
            for r in self._runners.values()
            for dev, b in r.usage()
            if dev.startswith("rpc:")
        }
        return SchedulerStatistics(
            queued=self._queued_count(),
            leased=sum(r.leases for r in self._runners.values()),
            loaded=states.count(RunnerState.READY),
            loading=states.count(RunnerState.LOADING),
            unloading=states.count(RunnerState.UNLOADING),
            runners=tuple(sorted(runners, key=lambda s: (s.expires_at, s.id))),
            queue=self._queue_stats(),
            remote=self._remote.statistics(remote_usage) if self._remote is not None else (),
            tenants=tuple(
                TenantStats(name, t.queued, t.leased) for name, t in sorted(self._tenants.items()) if name
            ),
            **self._counters,
        )

    def _queue_stats(self) -> tuple[QueueStats, ...]:
        by_model: dict[str, QueueStats] = {}
        for req in self._waiting.values():  # arrival order: the first of each model is its oldest
            q = by_model.get(req.model.name)
            by_model[req.model.name] = QueueStats(req.model.name, "", 1, req.arrived) if q is None else replace(q, waiting=q.waiting + 1)
        return tuple(by_model.values())

    # -- internals ----------------------------------------------------------------------------

    def _wake(self) -> None:
        """A change for the planner: the loop runs a pass (and waiters look again)."""
        self._dirty = True
        self._changes.set()

    async def _wait_changed(self) -> None:
        await self._changes.wait()

    def _note(self, event: str, model: ModelSpec, reason: str = "", seconds: float = 0.0) -> None:
        log.log(logging.DEBUG if event == "dispatch" else logging.INFO, "%s %s", event, model.name)
        if self.record is not None:
            self.record.append((event, model.short_name))
        if event in _EVENTS:
            self.events.add(event, model.name, reason, seconds)

    async def _wake_when_due(self) -> None:
        """Plan again when a held request becomes due (nothing else may change meanwhile)."""
        while True:
            with self._hold_timer:
                await trio.sleep_forever()
            self._hold_timer = trio.CancelScope()
            self._wake()

    async def _receive_requests(self) -> None:
        async with self._pending_recv:
            async for req in self._pending_recv:
                self._enqueue(req)
                # take the whole burst before the next pass (each receive() is a checkpoint)
                while True:
                    try:
                        self._enqueue(self._pending_recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                self._wake()

    def _enqueue(self, req: _Request) -> None:
        if not req.done.is_set():
            self._waiting[req.id] = req
            self._waiting_by_path.setdefault(req.model.path, {})[req.id] = req

    def _enqueue_in_order(self, req: _Request) -> None:
        """Queue ``req`` (queued again: its id is older than most) in arrival order, now."""
        self._enqueue(req)
        for waiting in (self._waiting, self._waiting_by_path[req.model.path]):
            if max(waiting) != req.id:  # others arrived after it (ids are given in arrival order)
                ordered = sorted(waiting.items())
                waiting.clear()
                waiting.update(ordered)
        self._wake()

    def _unqueue(self, req: _Request) -> bool:
        """Take ``req`` out of the waiting list; whether it was there."""
        if self._waiting.pop(req.id, None) is None:
            return False
        same = self._waiting_by_path[req.model.path]
        del same[req.id]
        if not same:
            del self._waiting_by_path[req.model.path]
        return True

    def _withdraw(self, req: _Request) -> None:
        """The requester left (cancelled): leave the queue, or give back a lease granted meanwhile."""
        if self._unqueue(req):
            self._note("left queue", req.model)
        if req.runner is not None and req.error is None:
            self.release_slot(req.runner)
        req.error = req.error or ShuttingDown()
        req.done.set()
        self._wake()

    def _finish(self, req: _Request, *, runner: Runner | None = None, error: TrioshedError | None = None) -> None:
        if req.done.is_set():
            return
        self._unqueue(req)
        req.runner, req.error = runner, error
        req.done.set()

    def release_slot(self, runner: Runner, tenant: str | None = None) -> None:
        if tenant is not None:
            self._tenants[tenant].leased -= 1
        runner.leases -= 1
        runner.last_used = trio.current_time()
        if self._hand_over(runner):
            self._changes.set()  # waiters look again; the planner has nothing new to decide
            return
        if runner.leases == 0 and runner.id in self._runners:
            if runner.evicting or runner.keep_alive <= 0:
                runner.stop(runner.unload_reason or "keep_alive 0")
            else:
                runner.timer.deadline = trio.current_time() + runner.keep_alive
        self._wake()

    def _remote_busy(self) -> set[str]:
        """The RPC servers our runners hold (each serves one client: not to be probed)."""
        return {e for r in self._runners.values() for e in r.placement.endpoints}

    def _hand_over(self, runner: Runner) -> bool:
        """Give a slot just freed straight to the oldest request waiting for this runner's model,
        when it can serve it: what the planner would decide (a loaded, usable runner with a free
        slot takes its model's requests at once, oldest first), without a planning pass over
        the whole queue. Nothing else changes (the runner stays leased), so no pass is needed.
        """
        same = self._waiting_by_path.get(runner.model.path)
        if not same or runner.id not in self._runners or not runner.free_slot:
            return False
        if sum(1 for t in self._tenants.values() if t.queued) > 1:
            return False  # several tenants wait: whose turn it is, is the planner's fair order
        oldest = next(iter(same.values()))
        if oldest.id >= runner.closed_from:
            return False  # a request of another model, older than it, is due to evict this one
        if not sched.can_serve(runner.view(), oldest.model, oldest.options):
            return False  # it waits for a reload: the planner decides
        self._dispatch(oldest, runner)
        return True

    def _machine(self) -> Machine:
        remote = self._remote
        return Machine(
            gpus=self._devices.poll() + (remote.devices() if remote is not None else ()),
            system=self._devices.system(),
            max_loaded=self.max_loaded,
            overhead=self._overhead,
            spread=self._spread,
            remote_down=remote.down() if remote is not None else (),
        )

    def _schedule(self) -> None:
        now = trio.current_time()
        if not self._waiting:
            self._hold_timer.deadline = math.inf
            for r in self._runners.values():
                r.closed_from = math.inf
            return
        self._counters["passes"] += 1
        requests = self._waiting.copy()
        actions = sched.plan(
            [r.view for r in self._waiting.values()],
            [r.view() for r in self._runners.values()],
            self._machine(),
            place=self._place,
            now=now,
            cooldowns=self._cooldowns,
            next_runner_id=-1,
            max_extra_wait=self.max_extra_wait,
        )
        for rid in actions.held:
            requests[rid].held(now)
        for r in self._runners.values():
            r.closed_from = actions.closed.get(r.id, math.inf)
        self._hold_timer.deadline = actions.wake_at
        provisional: dict[int, Runner] = {}
        for action in actions:
            match action:
                case Dispatch(request=rid, runner=runner_id):
                    runner = self._runners.get(runner_id) or provisional[runner_id]
                    self._dispatch(requests[rid], runner)
                case Load(request=rid, placement=placement):
                    runner = self._start_load(requests[rid], placement)
                    provisional[-(len(provisional) + 1)] = runner
                case Evict(runner=runner_id, reason=reason):
                    self._evict(self._runners[runner_id], reason)
                case Fail(request=rid, error=error):
                    if isinstance(error, InsufficientMemory) and self._shrink(
                        requests[rid], _memory(error), fits_larger=isinstance(error, SmallerContextPreferred)
                    ):
                        continue
                    if isinstance(error, SmallerContextPreferred):  # no smaller size after all: load it split
                        requests[rid].floor_estimate = None
                        requests[rid].__dict__.pop("view", None)
                        self._wake()
                        continue
                    self._note("failed", requests[rid].model)
                    self.events.refused(requests[rid].model.name, error)
                    self._finish(requests[rid], error=error)
        for wait in actions.waits:
            self._note_room_wait(requests[wait.request], wait)

    def _note_room_wait(self, req: _Request, wait: sched.RoomWait) -> None:
        """Count a request's first wait for memory and log it with its numbers (INFO; a later
        change of reason at DEBUG: every pass re-decides, and the first says what matters)."""
        if wait.reason == req.room_wait:
            return
        first = not req.room_wait
        req.room_wait = wait.reason
        if first:
            self._counters["room_waits"] += 1
            if self.record is not None:
                self.record.append(("wait for room", req.model.short_name))
        needed = "needs " + ", ".join(f"{_gib(b)} on {dev}" for dev, b in wait.needed)
        free = "free now: " + ", ".join(f"{dev} {_gib(b)}" for dev, b in wait.free)
        leaving = f"; waits for {', '.join(wait.victims)} to unload" if wait.victims else ""
        level = logging.INFO if first else logging.DEBUG
        log.log(level, "%s waits for memory: %s; %s (%s)%s", req.model.name, wait.reason, needed, free, leaving)

    def _dispatch(self, req: _Request, runner: Runner) -> None:
        now = trio.current_time()
        req.idle_for = now - runner.last_used if runner.leases == 0 and runner.served > 0 else 0.0
        runner.came_back = runner.served > 0 and (runner.leases > 0 or now - runner.last_used <= sched.RECENTLY_USED)
        runner.leases += 1
        runner.last_used = now
        runner.keep_alive = req.keep_alive
        runner.timer.deadline = math.inf
        req.load_duration = runner.load_duration if runner.served == 0 else 0.0
        self._fair.dispatched(req.share)
        runner.served += 1
        self._note("dispatch", req.model)
        self._finish(req, runner=runner)

    def _evict(self, runner: Runner, reason: str) -> None:
        runner.evicting = True
        runner.unload_reason = reason
        self._note("evict", runner.model, reason)
        if runner.leases == 0:
            runner.stop(reason)

    def _start_load(self, req: _Request, placement: Placement) -> Runner:
        assert self._nursery is not None
        runner = Runner(
            id=next(self._ids),
            model=req.model,
            options=req.options,
            placement=placement,
            estimate=req.estimate,
            keep_alive=req.keep_alive,
            pinned=self._session_pins.get(req.model.path, req.model.pinned),
            last_used=trio.current_time(),
            load_started=trio.current_time(),
        )
        self._runners[runner.id] = runner
        self._counters["loads"] += 1
        self._note("load", req.model)
        log.info(
            "loading %s: context %d tokens per slot x %d slot(s), batch %d", req.model.name,
            req.options.num_ctx, req.options.num_parallel, req.options.num_batch,
        )  # fmt: skip
        self._nursery.start_soon(self._runner_life, runner, name=f"runner {req.model.name}")
        return runner

    def _set_floor(self, req: _Request, floor: int) -> None:
        """``req`` may be made as small as ``floor`` (0: not at all): its estimate there, for the
        planner to see whether a smaller size keeps its layers on the GPUs."""
        req.floor = min(floor, req.options.num_ctx)
        req.floor_estimate = None
        if 0 < req.floor < req.options.num_ctx:
            with suppress(OSError, ValueError):  # read at admission already: cached
                req.floor_estimate = self._estimator(req.model, _sized(req.options, req.floor))
        req.__dict__.pop("view", None)  # the cached view carries it

    async def wait_resized(self, req: _Request, num_ctx: int) -> tuple[_Request, Runner]:
        """``req`` was served by a runner made smaller than it asked (``Lease.regrow``): wait for
        one at ``num_ctx``, the bucket of its exact count, never smaller."""
        again = req.again()
        again.options = _sized(req.options, num_ctx)
        try:
            again.estimate = self._estimator(again.model, again.options)
        except (OSError, ValueError) as exc:
            raise unreadable(again.model.name, again.model.path, exc) from None
        again.shrunk = None
        self._set_floor(again, num_ctx)
        return await self._pinged(again)

    def _shrink(self, req: _Request, why: str, *, fits_larger: bool = False) -> bool:
        """Place ``req`` once more at the next smaller automatic context, when its floor allows
        (its load did not fit, ran out of memory, or would spill layers to system memory where
        a smaller one would not, ``fits_larger``: ``why``); whether it was."""
        num_ctx = smaller_context(req.options.num_ctx, req.floor)
        if num_ctx is None:
            return False
        options = _sized(req.options, num_ctx)
        try:
            estimate = self._estimator(req.model, options)
        except (OSError, ValueError):
            return False
        log.info(
            "%s at context %d does not fit (%s); trying context %d", req.model.name, req.options.num_ctx, why, num_ctx
        )
        req.shrunk = Shrunk(req.shrunk.asked if req.shrunk else req.options.num_ctx, req.options.num_ctx, why, fits_larger)
        req.options, req.estimate, req.room_wait = options, estimate, ""
        req.__dict__.pop("view", None)  # the cached view carries the options
        if self.record is not None:
            self.record.append(("smaller context", req.model.short_name))
        self._wake()
        return True

    def _retry_smaller(self, runner: Runner, error: LoadFailed) -> bool:
        """A load failed: when llama.cpp ran out of memory, its waiters that asked a smaller
        context than the runner's (they joined a larger load) stay queued for their own size;
        the others with an automatic context are placed once more at a smaller one, or get a
        507 (LoadOutOfMemory) at their floor, and those with a size set fail with ``error``.
        Whether any was automatic or smaller (if not, nothing was done: the caller fails them
        all, with a cooldown; smaller sizes are still to be tried instead, and a request that
        needs less is not turned away meanwhile)."""
        line = out_of_memory(f"{error.stderr_tail}\n{error.message}")  # llama.cpp's own line first
        if not line:
            return False
        line = line.replace(runner.model.path, f"<{runner.model.name}>")  # no path reaches a client
        waiters = [
            req for req in self._waiting.values()
            if req.model.path == runner.model.path and sched.can_serve(runner.view(), req.model, req.options)
        ]  # fmt: skip
        if not any(req.floor or req.options.num_ctx < runner.options.num_ctx for req in waiters):
            return False
        for req in waiters:
            if req.options.num_ctx < runner.options.num_ctx:
                continue  # it joined a larger load: its own size is still to be tried
            if self._shrink(req, "llama.cpp ran out of memory loading it"):
                continue
            failure = LoadOutOfMemory(req.model.name, req.options.num_ctx, line) if req.floor else error
            self._note("failed", req.model)
            self.events.refused(req.model.name, failure)
            self._finish(req, error=failure)
        self._wake()
        return True

    def _fail_waiters(self, runner: Runner, error: TrioshedError) -> None:
        for req in list(self._waiting.values()):
            if req.model.path == runner.model.path and sched.can_serve(runner.view(), req.model, req.options):
                self._finish(req, error=error)


def _sized(options: RunnerOptions, num_ctx: int) -> RunnerOptions:
    return replace(options, num_ctx=num_ctx, num_batch=min(options.num_batch, num_ctx))


def _memory(error: InsufficientMemory) -> str:
    """The memory an InsufficientMemory names, in a few words (a smaller context's log and 507)."""
    if isinstance(error, SmallerContextPreferred):
        return error.reason
    if error.needed and error.available:
        return f"an estimated {_gib(error.needed)} needed, {_gib(error.available)} available"
    return error.message
