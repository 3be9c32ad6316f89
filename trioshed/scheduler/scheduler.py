"""The scheduler: requests in, leases on runners out.

Shape (Trio): ``run()`` owns a nursery holding every runner's lifetime task. Requests enter
through a bounded memory channel (full: :class:`QueueFull`, HTTP 503); a receiver task moves them
into the waiting list. Every change (a request arrives or leaves, a lease ends, a load completes
or fails, a runner exits) marks the state dirty; the loop then asks the pure planner
(:func:`trioshed.core.sched.plan`) what to do and performs it: dispatch, load, evict, fail.

A runner's lifetime task wraps the child in a cancel scope: unloading is cancelling it, and the
keep-alive timer *is* that scope's deadline (``inf`` while leased or kept forever, now + keep_alive
once idle). An unexpected exit of the child is seen at once by the same task.

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
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from trio_util import RepeatedEvent

from trioshed.core import sched
from trioshed.core.model import MeasuredMemory, MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.sched import Dispatch, Evict, Fail, Load, Machine, RunnerState
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import RemoteDevices, RemoteStats
from trioshed.errors import LoadFailed, QueueFull, RunnerCrashed, ShuttingDown, TrioshedError
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)

COOLDOWN_FIRST = 10.0
COOLDOWN_MAX = 300.0
VRAM_RECOVERY_TIMEOUT = 5.0
VRAM_POLL_INTERVAL = 0.25
HEALTH_INTERVAL = 15.0
REMOTE_CHECK_TIMEOUT = 3.0  # how long a crashed runner's RPC servers are checked before it is reported


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


class RunnerHandle(Protocol):
    """What the scheduler needs of a running child (real: LlamaServer; tests: a fake)."""

    base_url: str

    @property
    def pid(self) -> int | None: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def measured(self) -> MeasuredMemory | None: ...
    async def wait_exited(self) -> int | None: ...
    async def health(self) -> bool: ...


RunnerFactory = Callable[[ModelSpec, RunnerOptions, Placement], AbstractAsyncContextManager[Any]]
# (event, model name, reason, seconds): "load", "ready" (seconds: the load's
# duration), "evict" and "unloaded" (reason: the text given), "crashed", "load failed".
Observer = Callable[[str, str, str, float], None]
Estimator = Callable[[ModelSpec, RunnerOptions], MemoryEstimate]


@dataclass(eq=False)
class _Runner:
    id: int
    model: ModelSpec
    options: RunnerOptions
    placement: Placement
    estimate: MemoryEstimate
    state: RunnerState = RunnerState.LOADING
    leases: int = 0
    evicting: bool = False
    keep_alive: float = 300.0
    last_used: float = 0.0
    # scope: the whole life (cancelling it aborts a load); timer: the serving phase, whose deadline
    # is the keep-alive expiry and whose cancellation is an unload.
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    timer: trio.CancelScope = field(default_factory=lambda: trio.CancelScope(deadline=math.inf))
    served: int = 0
    _usage: tuple[tuple[str, int], ...] | None = None
    handle: Any = None
    load_started: float = 0.0
    load_duration: float = 0.0
    crash: RunnerCrashed | None = None
    unload_reason: str = ""

    def usage(self) -> tuple[tuple[str, int], ...]:
        """Bytes per device: the placement's prediction, scaled to llama.cpp's measured total
        (final once measured, so kept: every planning pass asks for every runner's usage)."""
        if self._usage is not None:
            return self._usage
        usage = sched.usage_of(self.placement)
        measured = self.handle.measured if self.handle is not None else None
        predicted = self.placement.total
        if measured is not None and measured.total > 0 and predicted > 0:
            scale = measured.total / predicted
            usage = tuple((dev, int(b * scale)) for dev, b in usage)
            self._usage = usage
        return usage

    @property
    def stopping(self) -> bool:
        return self.scope.cancel_called or self.timer.cancel_called

    def stop(self, reason: str) -> None:
        """Unload: cancel the serving phase (or the load itself, if still loading)."""
        self.timer.cancel(reason=reason)
        if self.state is RunnerState.LOADING:
            self.scope.cancel(reason=reason)

    def view(self) -> sched.RunnerView:
        state = RunnerState.UNLOADING if self.stopping else self.state
        return sched.RunnerView(
            id=self.id,
            model=self.model,
            options=self.options,
            state=state,
            leases=self.leases,
            evicting=self.evicting,
            keep_alive=self.keep_alive,
            last_used=self.last_used,
            usage=self.usage(),
            pinned=self.model.pinned,
        )


def _keep_alive(requested: float | None, model: ModelSpec, default: float) -> float:
    """The request's own keep-alive, else the model's (models.toml), else TRIOSHED_KEEP_ALIVE."""
    if requested is not None:
        return requested
    return default if model.keep_alive is None else model.keep_alive


@dataclass(eq=False)
class _Request:
    id: int
    model: ModelSpec
    options: RunnerOptions
    keep_alive: float
    estimate: MemoryEstimate
    done: trio.Event = field(default_factory=trio.Event)
    runner: _Runner | None = None
    error: TrioshedError | None = None
    load_duration: float = 0.0
    room_wait: str = ""  # why it waits for memory, as last logged ("" = it has not)

    @functools.cached_property
    def view(self) -> sched.RequestView:
        return sched.RequestView(self.id, self.model, self.options, self.estimate, priority=self.model.priority)


class Lease:
    """A request's hold on a runner slot, from dispatch until released (synchronous, idempotent)."""

    def __init__(self, scheduler: Scheduler, runner: _Runner, load_duration: float) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self.load_duration = load_duration
        self.released = False

    @property
    def model(self) -> ModelSpec:
        return self._runner.model

    @property
    def options(self) -> RunnerOptions:
        return self._runner.options

    @property
    def handle(self) -> Any:
        return self._runner.handle

    @property
    def base_url(self) -> str:
        return str(self._runner.handle.base_url)

    @property
    def crash(self) -> RunnerCrashed | None:
        """Set when the runner died under this lease: the error to give the client."""
        return self._runner.crash

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The RPC servers the runner uses (its crash is reported once they are checked)."""
        return self._runner.placement.endpoints

    def evict(self, reason: str) -> None:
        """The runner misbehaved under this lease (hung): replace it once its leases end."""
        runner = self._runner
        if not runner.evicting:
            runner.evicting = True
            runner.unload_reason = reason
            self._scheduler._note("evict", runner.model)
            self._scheduler._wake()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._scheduler._release(self._runner)


@dataclass(frozen=True)
class RunnerStats:
    id: int
    model: str
    path: str
    state: str
    leases: int
    slots: int
    waiting: int
    evicting: bool
    pid: int | None
    keep_alive: float
    expires_at: float  # wall-clock seconds; inf = never
    size: int
    size_vram: int
    context_length: int
    load_duration: float
    placement: Placement
    estimate: MemoryEstimate
    measured: MeasuredMemory | None
    options: RunnerOptions = field(default_factory=RunnerOptions)  # what the runner was started with
    usage: tuple[tuple[str, int], ...] = ()  # bytes per device id ("cpu" = system memory)


@dataclass(frozen=True)
class SchedulerStatistics:
    queued: int
    leased: int
    loaded: int
    loading: int
    unloading: int
    runners: tuple[RunnerStats, ...]
    loads: int
    unloads: int
    crashes: int
    load_failures: int
    rejected: int
    room_waits: int = 0  # requests that had to wait for memory (counted once each)
    passes: int = 0  # planning passes run (a freed slot handed to a waiter needs none)
    remote: tuple[RemoteStats, ...] = ()  # TRIOSHED_RPC_SERVERS: state, size, user


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
        self.max_loaded = sched.default_max_loaded(max_loaded_models, len(devices.gpus))
        self.default_keep_alive = default_keep_alive
        self._overhead = gpu_overhead
        self._spread = spread
        self.record = record  # (event, model) in order: for tests and debugging
        # Told of loads, evictions, unloads and crashes as they happen (what /metrics counts by
        # reason and times; a snapshot cannot hold every load's duration). Synchronous; must not block.
        self.observer: Observer | None = None
        # Requests enter here; the buffer is the queue bound (TRIOSHED_MAX_QUEUE).
        self._pending_send, self._pending_recv = trio.open_memory_channel[_Request](max_queue)
        self._waiting: dict[int, _Request] = {}  # arrival order
        self._waiting_by_path: dict[str, dict[int, _Request]] = {}  # the same, per model file
        self._runners: dict[int, _Runner] = {}
        self._cooldowns: dict[str, tuple[float, str]] = {}
        self._backoff: dict[str, float] = {}
        self._changes = RepeatedEvent()  # set on every change the planner or a waiter cares about
        self._dirty = False  # a change the planner must look at (others only wake waiters)
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._closing = False
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
        self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None = None
    ) -> AsyncIterator[Lease]:
        """Wait for a runner of ``model`` with ``options`` and hold a slot on it.

        Raises QueueFull (503) at once when the queue is full; the planner's errors (507, 503
        cooldown, load failures) when they apply. Cancellation while waiting leaves the queue.
        """
        lease = await self.wait_for_lease(model, options, keep_alive)
        try:
            yield lease
        finally:
            lease.release()

    async def wait_for_lease(self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None) -> Lease:
        if self._closing or self._nursery is None:
            raise ShuttingDown()
        trace, arrived = current_trace.get(), trio.current_time()
        try:
            estimate = self._estimator(model, options)  # cached GGUF header read: microseconds once warm
        except (OSError, ValueError) as exc:
            raise LoadFailed(f"cannot read model '{model.name}' ({model.path}): {exc}") from None
        req = _Request(
            id=next(self._ids),
            model=model,
            options=options,
            keep_alive=_keep_alive(keep_alive, model, self.default_keep_alive),
            estimate=estimate,
        )
        runner = self._free_slot_now(req) if self._nothing_ahead(req) else None
        if runner is not None:
            # Fast path, FIFO-safe because nothing for this model waits ahead of it: a ready
            # runner has a free slot (the planner would dispatch it at once too).
            await trio.lowlevel.checkpoint_if_cancelled()
            self._dispatch(req, runner)
            await trio.lowlevel.cancel_shielded_checkpoint()
            if trace is not None:
                trace.leased(model.name, 0.0, req.load_duration)
            return Lease(self, runner, req.load_duration)
        self.submit_nowait(req)
        try:
            await req.done.wait()
        except BaseException:
            self._withdraw(req)
            raise
        if req.error is not None:
            raise req.error
        assert req.runner is not None
        if trace is not None:
            trace.leased(model.name, trio.current_time() - arrived, req.load_duration)
        return Lease(self, req.runner, req.load_duration)

    def _nothing_ahead(self, req: _Request) -> bool:
        """No request for ``req``'s model waits, nor any still in the channel (of unknown model)."""
        return req.model.path not in self._waiting_by_path and not self._pending_send.statistics().current_buffer_used

    def _queued_count(self) -> int:
        return len(self._waiting) + self._pending_send.statistics().current_buffer_used

    def _free_slot_now(self, req: _Request) -> _Runner | None:
        for runner in self._runners.values():
            if (
                runner.model.path == req.model.path
                and runner.state is RunnerState.READY
                and not runner.evicting
                and not runner.stopping
                and runner.leases < runner.options.num_parallel
                and sched.can_serve(runner.view(), req.model, req.options)
            ):
                return runner
        return None

    def runner_models(self) -> list[ModelSpec]:
        """The model each runner was started from (a models.toml reload compares them)."""
        return [r.model for r in self._runners.values()]

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
            raise QueueFull()
        try:
            self._pending_send.send_nowait(req)
        except trio.WouldBlock:
            self._counters["rejected"] += 1
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
        runners = []
        for r in self._runners.values():
            view = r.view()
            waiting = len(self._waiting_by_path.get(r.model.path, ()))
            if r.leases > 0 or r.state is RunnerState.LOADING:
                expires = math.inf if r.keep_alive == math.inf else wall + r.keep_alive
            else:
                expires = math.inf if r.timer.deadline == math.inf else wall + max(0.0, r.timer.deadline - now)
            usage = dict(view.usage)
            size = sum(usage.values())
            runners.append(
                RunnerStats(
                    id=r.id,
                    model=r.model.name,
                    path=r.model.path,
                    state=view.state.value,
                    leases=r.leases,
                    slots=r.options.num_parallel,
                    waiting=waiting,
                    evicting=r.evicting,
                    pid=r.handle.pid if r.handle is not None else None,
                    keep_alive=r.keep_alive,
                    expires_at=expires,
                    size=size,
                    size_vram=size - usage.get(sched.CPU_ID, 0),
                    context_length=r.options.num_ctx,
                    load_duration=r.load_duration,
                    placement=r.placement,
                    estimate=r.estimate,
                    measured=r.handle.measured if r.handle is not None else None,
                    options=r.options,
                    usage=view.usage,
                )
            )
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
            remote=self._remote.statistics(remote_usage) if self._remote is not None else (),
            **self._counters,
        )

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
        if self.observer is not None and event != "dispatch":
            self.observer(event, model.name, reason, seconds)

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
            self._release(req.runner)
        req.error = req.error or ShuttingDown()
        req.done.set()
        self._wake()

    def _finish(self, req: _Request, *, runner: _Runner | None = None, error: TrioshedError | None = None) -> None:
        if req.done.is_set():
            return
        self._unqueue(req)
        req.runner, req.error = runner, error
        req.done.set()

    def _release(self, runner: _Runner) -> None:
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

    def _hand_over(self, runner: _Runner) -> bool:
        """Give a slot just freed straight to the oldest request waiting for this runner's model,
        when it can serve it: what the planner would decide (a loaded, usable runner with a free
        slot takes its model's requests at once, oldest first), without a planning pass over
        the whole queue. Nothing else changes (the runner stays leased), so no pass is needed.
        """
        same = self._waiting_by_path.get(runner.model.path)
        if (
            not same
            or runner.id not in self._runners
            or runner.state is not RunnerState.READY
            or runner.evicting
            or runner.stopping
            or runner.leases >= runner.options.num_parallel
        ):
            return False
        oldest = next(iter(same.values()))
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
        )
        provisional: dict[int, _Runner] = {}
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
                    self._note("failed", requests[rid].model)
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

    def _dispatch(self, req: _Request, runner: _Runner) -> None:
        runner.leases += 1
        runner.last_used = trio.current_time()
        runner.keep_alive = req.keep_alive
        runner.timer.deadline = math.inf
        req.load_duration = runner.load_duration if runner.served == 0 else 0.0
        runner.served += 1
        self._note("dispatch", req.model)
        self._finish(req, runner=runner)

    def _evict(self, runner: _Runner, reason: str) -> None:
        runner.evicting = True
        runner.unload_reason = reason
        self._note("evict", runner.model, reason)
        if runner.leases == 0:
            runner.stop(reason)

    def _start_load(self, req: _Request, placement: Placement) -> _Runner:
        assert self._nursery is not None
        runner = _Runner(
            id=next(self._ids),
            model=req.model,
            options=req.options,
            placement=placement,
            estimate=req.estimate,
            keep_alive=req.keep_alive,
            last_used=trio.current_time(),
            load_started=trio.current_time(),
        )
        self._runners[runner.id] = runner
        self._counters["loads"] += 1
        self._note("load", req.model)
        self._nursery.start_soon(self._runner_life, runner, name=f"runner {req.model.name}")
        return runner

    def _fail_waiters(self, runner: _Runner, error: TrioshedError) -> None:
        for req in list(self._waiting.values()):
            if req.model.path == runner.model.path and sched.can_serve(runner.view(), req.model, req.options):
                self._finish(req, error=error)

    async def _runner_life(self, runner: _Runner) -> None:
        """Load, serve until stopped (timer cancelled or keep-alive deadline) or crashed, clean up."""
        try:
            with runner.scope:
                try:
                    async with self._factory(runner.model, runner.options, runner.placement) as handle:
                        self._on_ready(runner, handle)
                        with runner.timer:
                            async with trio.open_nursery() as watchers:
                                watchers.start_soon(self._monitor_health, runner, handle)
                                await handle.wait_exited()
                                watchers.cancel_scope.cancel()
                            with trio.CancelScope(shield=True):  # bounded: REMOTE_CHECK_TIMEOUT
                                cause = await self._check_remote(runner)
                            self._on_crash(runner, cause)
                            return
                        # Stopped (unload, eviction, keep-alive expiry): the child is still alive here,
                        # so this is the moment to read the GPUs' free memory before it goes.
                        runner.state = RunnerState.UNLOADING
                        baseline = self._vram_baseline(runner)
                    self._counters["unloads"] += 1
                    expired = "keep_alive 0" if runner.keep_alive <= 0 else "keep_alive expired"
                    self._note("unloaded", runner.model, runner.unload_reason or expired)
                    if baseline is not None:
                        await self._wait_for_vram_recovery(runner, baseline)
                except LoadFailed as exc:
                    with trio.CancelScope(shield=True):  # bounded: REMOTE_CHECK_TIMEOUT
                        lost = await self._lost_remote(runner)
                    if lost:
                        self._on_remote_load_lost(runner, lost)
                    else:
                        self._on_load_failed(runner, exc)
                except (OSError, RuntimeError) as exc:
                    self._on_load_failed(runner, LoadFailed(f"cannot run llama-server: {exc}"))
        finally:
            self._runners.pop(runner.id, None)
            self._wake()

    async def _monitor_health(self, runner: _Runner, handle: Any) -> None:
        """Ping ``/health`` every HEALTH_INTERVAL; two failures in a row reload the runner.

        The exit watcher sees a dead child at once; this catches a live but hung one (the
        reference pings on every reuse instead, adding a round trip to each request).
        """
        failures = 0
        while True:
            await trio.sleep(HEALTH_INTERVAL)
            failures = 0 if await handle.health() else failures + 1
            if failures >= 2:
                self._note("unhealthy", runner.model)
                runner.evicting = True
                runner.unload_reason = "health check failed"
                if runner.leases == 0:
                    runner.stop("health check failed")
                self._wake()
                return

    def _on_ready(self, runner: _Runner, handle: Any) -> None:
        runner.handle = handle
        runner.state = RunnerState.READY
        runner.load_duration = trio.current_time() - runner.load_started
        self._cooldowns.pop(runner.model.path, None)
        self._backoff.pop(runner.model.path, None)
        self._note("ready", runner.model, seconds=runner.load_duration)
        self._wake()

    async def _lost_remote(self, runner: _Runner) -> list[str]:
        """The RPC servers of ``runner`` that answer no more ("address (why)"), checked now."""
        if not runner.placement.endpoints or self._remote is None:
            return []
        with trio.move_on_after(REMOTE_CHECK_TIMEOUT):
            return await self._remote.check(runner.placement.endpoints)
        return []

    def _on_remote_load_lost(self, runner: _Runner, lost: list[str]) -> None:
        """A load failed because an RPC server went away: no back-off for the model; its waiting
        requests stay queued and are placed again without that server."""
        self._counters["load_failures"] += 1
        log.warning("load of %s failed: RPC server %s stopped answering", runner.model.name, ", ".join(lost))
        self._note("load failed", runner.model)
        self._runners.pop(runner.id, None)

    async def _check_remote(self, runner: _Runner) -> str:
        """A runner on RPC servers exited: which of them stopped answering? (The cause to report.)

        The runner takes no new lease meanwhile, and its servers stay out of placement (its
        usage still holds them) until the check is done.
        """
        endpoints = runner.placement.endpoints
        if not endpoints or self._remote is None:
            return ""
        runner.state = RunnerState.UNLOADING
        self._wake()
        lost: list[str] | None = None
        with trio.move_on_after(REMOTE_CHECK_TIMEOUT):
            lost = await self._remote.check(endpoints)
        if lost:
            return (
                f"its RPC server {', '.join(lost)} stopped answering; it is left out of placement "
                "until it answers again"
            )
        return f"it ran on the RPC servers {', '.join(endpoints)}" + (
            ", which still answer" if lost is not None else ""
        )

    def _on_crash(self, runner: _Runner, cause: str = "") -> None:
        """The child exited on its own: forget the runner now, so the next request reloads."""
        self._counters["crashes"] += 1
        tail = getattr(runner.handle, "tail", None)
        runner.crash = RunnerCrashed(
            runner.model.name, runner.handle.returncode, tail.errors() if tail is not None else "", cause
        )
        runner.state = RunnerState.UNLOADING
        self._runners.pop(runner.id, None)
        self._note("crashed", runner.model)
        self._wake()

    def _on_load_failed(self, runner: _Runner, exc: LoadFailed) -> None:
        self._counters["load_failures"] += 1
        path = runner.model.path
        self._backoff[path] = min(self._backoff.get(path, COOLDOWN_FIRST / 2) * 2, COOLDOWN_MAX)
        self._cooldowns[path] = (trio.current_time() + self._backoff[path], exc.message[:300])
        self._note("load failed", runner.model)
        self._runners.pop(runner.id, None)
        self._fail_waiters(runner, exc)

    def _vram_baseline(self, runner: _Runner) -> int | None:
        if not (runner.placement.devices and self._devices.recovers_vram):
            return None
        ids = set(runner.placement.devices)
        return sum(d.free for d in self._devices.poll() if d.id in ids)

    async def _wait_for_vram_recovery(self, runner: _Runner, baseline: int) -> None:
        """Free GPU memory lags behind a child's exit: wait until ~80% of its use is back."""
        expected = sum(b for dev, b in runner.usage() if dev != sched.CPU_ID)
        ids = set(runner.placement.devices)
        with trio.move_on_after(VRAM_RECOVERY_TIMEOUT) as scope:
            while True:
                # NVML's memory query takes microseconds: called inline, like the planner's
                if sum(d.free for d in self._devices.poll() if d.id in ids) - baseline >= 0.8 * expected:
                    break
                await trio.sleep(VRAM_POLL_INTERVAL)
        if scope.cancelled_caught:
            log.warning("GPU memory of %s did not recover within %.0fs", runner.model.name, VRAM_RECOVERY_TIMEOUT)
