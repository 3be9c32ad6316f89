"""The scheduler's decisions: which waiting request gets which runner, what to load, what to evict.

``plan()`` is pure: it takes snapshots of the waiting requests (in arrival order), the runners and
the machine, and returns the actions to perform. The Trio loop (``trioshed.scheduler``) performs
them and calls ``plan()`` again whenever something changes (a request arrives or leaves, a lease
ends, a load completes or fails, a runner exits). Where Ollama's ``processPending`` blocks the
whole queue while one request waits for memory, ``plan()`` looks at every waiting request:

* a request whose model is loaded, usable and not being evicted is dispatched at once, whatever
  waits ahead of it (no head-of-line blocking);
* a request that needs memory evicts victims (idle first, then shortest keep-alive, then least
  recently used) and *reserves* the memory it waits for, so later requests cannot take it;
* a runner chosen as a victim takes no new leases (no starvation of the request that evicted it);
* a model that cannot fit even with everything evicted fails at once (507), never an eviction loop;
  one that would fit only with an RPC server that is down fails with 503 naming that server;
* an RPC server (``Device.is_remote``) serves one llama-server at a time: while a runner uses it
  (or a request has reserved it) it counts as full for every other placement.

Swap-aware with a bound (``max_extra_wait`` > 0, TRIOSHED_MAX_EXTRA_WAIT): a swap costs a load
(seconds to minutes), so a request that would evict a runner whose model still has requests
queued (or that is busy serving) *holds* its swap instead, and the runner serves them first. Two
kinds of queued requests hold it: those that arrived before the request (that is arrival order:
always), and those that arrived after it (and a runner's leases), only until the request has been
held ``max_extra_wait`` seconds (counted from the first pass that held it,
``RequestView.held_since``). From then on the request is *due*: the
victims take no request that arrived after it (``Plan.closed``) and are evicted once the earlier
ones have their slots. Victims are chosen among runners with nothing queued first, then of lower
``priority``. With ``max_extra_wait`` 0 a swap is held only for the requests that arrived before
it: arrival order, as in Ollama's queue (trioshed before evicted the runner at once and loaded it
again for them).
"""

from __future__ import annotations

import enum
import functools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from trioshed.core.model import (
    Device,
    DoesNotFit,
    MeasuredMemory,
    MemoryEstimate,
    ModelSpec,
    Placement,
    RunnerOptions,
)
from trioshed.core.placement import gpu_layer_count
from trioshed.errors import (
    InsufficientMemory,
    LoadCooldown,
    PinnedModelsInTheWay,
    RemoteUnavailable,
    SmallerContextPreferred,
    TrioshedError,
)

CPU_ID = "cpu"


class RunnerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


@dataclass(frozen=True)
class RunnerView:
    id: int
    model: ModelSpec
    options: RunnerOptions
    state: RunnerState
    leases: int = 0
    evicting: bool = False
    keep_alive: float = 300.0
    last_used: float = 0.0
    usage: tuple[tuple[str, int], ...] = ()  # bytes per device id ("cpu" = system memory)
    pinned: bool = False  # models.toml pinned: never chosen as a victim
    #: Its latest request came while it was busy or within :data:`RECENTLY_USED` seconds of
    #: the one before: its clients come straight back, so a recent use holds a swap.
    came_back: bool = False

    @property
    def slots(self) -> int:
        return self.options.num_parallel

    @property
    def idle(self) -> bool:
        return self.leases == 0


@dataclass(frozen=True)
class RequestView:
    id: int
    model: ModelSpec
    options: RunnerOptions
    estimate: MemoryEstimate
    priority: int = 0  # models.toml priority: higher is planned first
    held_since: float | None = None  # when a pass first held its swap for another model's queue
    tenant: str = ""  # the API key's name: slots are shared between tenants by weight
    share: float = 0.0  # its start tag in the weighted fair order (FairShare.arrive)
    arrived: float = 0.0  # when it reached the scheduler (priority ages after max_extra_wait)
    #: its estimate at the smallest automatic context it may be made (None: it may not be made
    #: smaller): a size that would spill layers to system memory, or evict other models, where
    #: that one would not, fails with SmallerContextPreferred for the scheduler to try a smaller one
    floor_estimate: MemoryEstimate | None = None

    @functools.cached_property
    def key(self) -> tuple[object, ...]:
        """What makes two requests interchangeable for the planner (same runner would serve)."""
        return (self.model.path, self.model.adapters, self.model.projector, self.options)


@dataclass(frozen=True)
class Machine:
    """What the scheduler may use. ``gpus[i].free`` is the free memory the device *reports*
    (NVML) or its total (declared inventory); ``system`` is system memory (free = available)."""

    gpus: tuple[Device, ...]
    system: Device
    max_loaded: int
    overhead: int = 0
    spread: bool = False
    #: RPC servers that do not answer now (their last known size; ``name`` says why): placement
    #: leaves them out, and a model that would fit only with them gets a 503, not a 507.
    remote_down: tuple[Device, ...] = ()


@dataclass(frozen=True)
class Dispatch:
    request: int
    runner: int


@dataclass(frozen=True)
class Load:
    request: int
    placement: Placement


@dataclass(frozen=True)
class Evict:
    runner: int
    reason: str


@dataclass(frozen=True)
class Fail:
    request: int
    error: TrioshedError


Action = Dispatch | Load | Evict | Fail


@dataclass(frozen=True)
class RoomWait:
    """A request that stays queued for want of memory (or of a runner place): why, and the
    numbers, for the log line and the ``room_waits`` counter. Not an action: nothing to do.

    ``needed``: bytes per device it waits for (its reservation), or its estimate's total in
    system terms when it reserved nothing; ``free``: bytes per device physically free now;
    ``victims``: runners being evicted, for it or before it, that it waits for.
    """

    request: int
    model: str
    reason: str
    needed: tuple[tuple[str, int], ...]
    free: tuple[tuple[str, int], ...]
    reserved: bool
    victims: tuple[str, ...] = ()


class Plan(list[Action]):
    """``plan()``'s actions, in order, plus ``waits``: the requests left waiting for room.

    A list, so that callers and tests that compare actions keep working unchanged.
    """

    def __init__(self, actions: Sequence[Action] = (), waits: Sequence[RoomWait] = ()) -> None:
        super().__init__(actions)
        self.waits: list[RoomWait] = list(waits)
        #: requests whose swap this pass held for another model's queued requests (the caller
        #: stamps ``held_since`` on the first)
        self.held: list[int] = []
        #: runner id -> the first request id it may no longer take (requests arrived at or after
        #: a due request that waits to evict it); the caller's fast paths must respect it too
        self.closed: dict[int, int] = {}
        #: when a held request becomes due: plan again then, even if nothing else changes
        self.wake_at: float = math.inf
Placer = Callable[..., Placement | DoesNotFit]


def default_max_loaded(configured: int, gpu_count: int) -> int:
    """TRIOSHED_MAX_LOADED_MODELS, where 0 means 3 per GPU (3 on CPU)."""
    return configured if configured > 0 else 3 * max(1, gpu_count)


def same_files(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs name the same files, the model's in the same state (size, mtime)."""
    return (a.path, a.adapters, a.projector, a.size, a.modified) == (b.path, b.adapters, b.projector, b.size, b.modified)


def can_serve(runner: RunnerView, model: ModelSpec, options: RunnerOptions) -> bool:
    """Whether ``runner`` can serve a request without a reload.

    Same file (as it was when loaded: a file replaced since has another size or modification
    time, and is loaded again), adapters and projector; equal runner options, except that
    ``num_gpu < 0`` (auto) never forces a reload, a smaller ``num_ctx`` is served by a larger
    runner (ollama#6148), and a runner started for embeddings serves generation too.
    """
    if not same_files(runner.model, model):
        return False
    have, want = runner.options, options
    if have == want:
        return True  # the common case, without the copies below (a planning pass asks often)
    if have.embedding and not want.embedding:
        want = replace(want, embedding=True)  # an embedding runner generates too
    if want.num_gpu < 0:
        want = replace(want, num_gpu=have.num_gpu)
    if want.num_ctx <= have.num_ctx:
        want = replace(want, num_ctx=have.num_ctx)
    return have == want


def victim_order(runner: RunnerView) -> tuple[bool, float, float, int]:
    """Sort key for eviction: idle first, then the shortest keep-alive, the least recently used."""
    return (runner.leases > 0, runner.keep_alive, runner.last_used, runner.id)


def _leaving(r: RunnerView) -> bool:
    return r.evicting or r.state is RunnerState.UNLOADING


def _in_system_memory(r: RunnerView) -> bool:
    return all(dev == CPU_ID for dev, _ in r.usage)


class _Sim:
    """The machine as this planning pass has committed it so far.

    Bookkeeping is incremental (usage per device, runners per model file, counts), so that one
    pass costs about O(requests + runners) rather than their product.
    """

    def __init__(
        self,
        machine: Machine,
        runners: Sequence[RunnerView],
        victim_key: Callable[[RunnerView], tuple[object, ...]] | None = None,
    ) -> None:
        self.machine = machine
        self.victim_key: Callable[[RunnerView], tuple[object, ...]] = victim_key or victim_order
        self.runners: dict[int, RunnerView] = {}
        self.by_path: dict[str, list[int]] = defaultdict(list)
        self.used_all: Counter[str] = Counter()  # every runner of ours, leaving ones included
        self.used_kept: Counter[str] = Counter()  # the ones that stay
        # Loading ones: not yet allocated, so not yet missing from a device's reported free
        self.used_loading: Counter[str] = Counter()
        self.kept = 0
        # Leaving with no lease: the scheduler stops them at once, so they do not count against
        # max_loaded (their memory still does, until it is really free).
        self.idle_leaving = 0
        self.unsettled = 0  # loading, leaving or being evicted
        self.reserved: dict[str, tuple[tuple[str, int], ...]] = {}  # model path -> usage waited for
        self.reserved_usage: Counter[str] = Counter()
        self.touched: set[int] = set()  # runners given a lease in this pass
        self._order: list[int] | None = None
        self.any_pinned = False
        for r in runners:
            self.add(r)

    def _account(self, r: RunnerView, sign: int) -> None:
        for dev, b in r.usage:
            self.used_all[dev] += sign * b
            if not _leaving(r):
                self.used_kept[dev] += sign * b
            if r.state is RunnerState.LOADING:
                self.used_loading[dev] += sign * b
        if not _leaving(r):
            self.kept += sign
        if _leaving(r) or r.state is not RunnerState.READY:
            self.unsettled += sign
        if _leaving(r) and r.leases == 0:
            self.idle_leaving += sign

    def add(self, r: RunnerView) -> None:
        self.runners[r.id] = r
        self.by_path[r.model.path].append(r.id)
        self.any_pinned = self.any_pinned or r.pinned
        self._account(r, +1)

    def set(self, r: RunnerView) -> None:
        self._account(self.runners[r.id], -1)
        self.runners[r.id] = r
        self._account(r, +1)

    def same_model(self, path: str) -> list[RunnerView]:
        return [self.runners[i] for i in self.by_path.get(path, ())]

    def reserve(self, path: str, usage: tuple[tuple[str, int], ...]) -> None:
        self.reserved[path] = usage
        self.reserved_usage.update(dict(usage))

    def _room(self, d: Device, extra: Counter[str] | None = None) -> tuple[int, int]:
        """Bytes of ``d`` a new runner may take (now, after).

        *Now* is what is physically free: the device's report less what our loading runners
        are still to allocate (the report already counts the others), and at most its total less
        everything our runners hold (leaving ones too; reservations are not loaded yet, so they
        take nothing now). *After* is once every pending eviction (and the would-be victims'
        ``extra``) is gone and every reservation is loaded.
        """
        held = self.used_all[d.id]  # ours, in memory now or being allocated
        reported = d.free - self.used_loading[d.id]
        kept = self.used_kept[d.id] - (extra[d.id] if extra else 0)  # ours once leavers are gone
        after = min(reported + (held - kept), d.total - kept) - self.reserved_usage[d.id]
        now = min(reported, d.total - held)
        return max(0, now), max(0, after)

    def _devices(self, *, projected: bool, extra: Counter[str] | None = None) -> tuple[tuple[Device, ...], int]:
        """GPUs and system memory free for a new runner: once evictions settle (``projected``,
        for making room), else for loading at once, which must fit both now and after."""

        def free(d: Device) -> int:
            now, after = self._room(d, extra)
            return after if projected else min(now, after)

        gpus = tuple(replace(d, free=0 if self._taken(d, projected, extra) else free(d)) for d in self.machine.gpus)
        return gpus, free(self.machine.system)

    def _taken(self, d: Device, projected: bool, extra: Counter[str] | None) -> bool:
        """An RPC server already used (or reserved) by a runner: it serves one client at a time."""
        if not d.is_remote:
            return False
        if not projected:
            return self.used_all[d.id] + self.reserved_usage[d.id] > 0
        return self.used_kept[d.id] - (extra[d.id] if extra else 0) + self.reserved_usage[d.id] > 0

    def system_capacity(self) -> int:
        """System memory a runner could have with none of ours loaded."""
        system = self.machine.system
        return min(system.total, system.free - self.used_loading[CPU_ID] + self.used_all[CPU_ID])

    def count(self, *, projected: bool, extra: int = 0) -> int:
        """Runners once pending evictions (and ``extra`` victims) are gone and reservations are
        loaded (``projected``); else the larger of that and the processes serving now (an idle
        runner being stopped no longer serves: a swap loads beside its exit, as a cold start)."""
        after = self.kept - extra + len(self.reserved)
        return after if projected else max(after, len(self.runners) - self.idle_leaving)

    def _place(self, place: Placer, req: RequestView, gpus: tuple[Device, ...], system_free: int) -> Placement | DoesNotFit:
        return place(
            req.estimate,
            gpus,
            system_free=system_free,
            num_gpu=req.options.num_gpu,
            spread=self.machine.spread,
            overhead=self.machine.overhead,
        )

    def place(self, place: Placer, req: RequestView, *, projected: bool) -> Placement | DoesNotFit:
        return self._place(place, req, *self._devices(projected=projected))

    def fits_after(
        self, place: Placer, req: RequestView, victims: Sequence[RunnerView], min_layers: int = 0
    ) -> Placement | None:
        """Where ``req`` would go once pending evictions and ``victims`` are gone, with at least
        ``min_layers`` layers on GPUs, if anywhere."""
        extra: Counter[str] = Counter()
        for v in victims:
            extra.update(dict(v.usage))
        if self.count(projected=True, extra=len(victims)) >= self.machine.max_loaded:
            return None
        result = self._place(place, req, *self._devices(projected=True, extra=extra))
        return result if isinstance(result, Placement) and result.n_gpu_layers >= min_layers else None

    def free_now(self) -> tuple[tuple[str, int], ...]:
        """Bytes physically free now on every GPU and in system memory (for messages)."""
        devices = (*self.machine.gpus, self.machine.system)
        return tuple((d.id, self._room(d)[0]) for d in devices)

    def leaving(self) -> tuple[str, ...]:
        return tuple(sorted({r.model.name for r in self.runners.values() if _leaving(r)}))

    def capacity(
        self, place: Placer, req: RequestView, system_capacity: int, extra_gpus: tuple[Device, ...] = ()
    ) -> Placement | DoesNotFit:
        gpus = tuple(replace(d, free=d.total) for d in (*self.machine.gpus, *extra_gpus))
        return self._place(place, req, gpus, system_capacity)

    def pinned(self) -> list[RunnerView]:
        if not self.any_pinned:
            return []
        return [r for r in self.runners.values() if r.pinned and not _leaving(r)]

    def candidates(self) -> list[RunnerView]:
        """Possible victims in eviction order (never pinned ones); sorted once a pass, runners
        leased meanwhile last."""
        if self._order is None:
            ready = [r for r in self.runners.values() if r.state is RunnerState.READY and not r.evicting and not r.pinned]
            self._order = [r.id for r in sorted(ready, key=self.victim_key)]
        live = [self.runners[i] for i in self._order if not self.runners[i].evicting]
        return [r for r in live if r.id not in self.touched] + [r for r in live if r.id in self.touched]


def usage_of(placement: Placement) -> tuple[tuple[str, int], ...]:
    usage = dict(placement.vram)
    if placement.ram:
        usage[CPU_ID] = usage.get(CPU_ID, 0) + placement.ram
    return tuple(sorted(usage.items()))


def measured_usage(
    placement: Placement, measured: MeasuredMemory, backends: Sequence[str]
) -> tuple[tuple[str, int], ...] | None:
    """Bytes per device as llama.cpp reported allocating them (its ``-v`` buffer lines).

    ``backends`` are llama.cpp's names of ``placement.devices`` (``Vulkan0``, ``RPC0``). Host
    buffers (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``Vulkan_Host``, ``CUDA_Host``) are system
    memory. None when the report does not match the plan: a planned device with no buffer (a
    declared inventory, whose children run on the CPU) or a buffer on a device not planned.
    """
    names = dict(zip(backends, placement.devices, strict=True))
    usage: dict[str, int] = {}
    for name, n in measured.by_backend().items():
        if name.startswith("CPU") or name.endswith("_Host"):
            device = CPU_ID
        elif name in names:
            device = names[name]
        elif (base := name.partition("[")[0]) in names:  # "RPC0[10.0.0.2:50052]"
            device = names[base]
        else:
            return None
        usage[device] = usage.get(device, 0) + n
    if any(d not in usage for d in placement.devices):
        return None
    return tuple(sorted(usage.items()))


def plan(
    requests: Sequence[RequestView],
    runners: Sequence[RunnerView],
    machine: Machine,
    *,
    place: Placer,
    now: float,
    cooldowns: Mapping[str, tuple[float, str]] | None = None,
    next_runner_id: int = -1,
    max_extra_wait: float = 0.0,
) -> Plan:
    """Decide what to do for every waiting request, highest priority first, then oldest first.
    Pure: no I/O, no clock.

    A request loads at once when it fits both in the memory physically free now and beside
    every reservation once every pending eviction has settled; else it makes room. The result
    lists the actions in order; its ``waits`` say which requests wait for room, and why.

    ``cooldowns`` maps a model path to (until, cause) after a failed load. Runners created by a
    ``Load`` in this pass are given ids counting down from ``next_runner_id`` so that later
    requests for the same model join them (the caller maps them to the runners it creates).

    ``max_extra_wait``: how long a request's swap may be held for later requests of the models it
    would evict (0: never; see the module's docstring).

    Several tenants (API keys): within a priority, requests are planned in weighted fair order
    (:func:`fair_order`, by the start tags :class:`FairShare` gave them), so a tenant that floods
    the queue cannot push another's requests back by more than its share.
    """
    actions = Plan()
    queue = _Queue(requests, max_extra_wait, now)
    sim = _Sim(machine, runners, queue.victim_key if max_extra_wait > 0 else None)
    cooldowns = cooldowns or {}
    system_capacity = sim.system_capacity()
    new_id = next_runner_id
    waiting: set[tuple[object, ...]] = set()  # requests like these already wait in this pass
    held: set[tuple[object, ...]] = set()  # ... and their swap is held

    def load(req: RequestView, placement: Placement) -> None:
        nonlocal new_id
        actions.append(Load(req.id, placement))
        sim.add(RunnerView(new_id, req.model, req.options, RunnerState.LOADING, usage=usage_of(placement), last_used=now,
                           pinned=req.model.pinned))  # fmt: skip
        new_id -= 1

    for req in fair_order(requests, now=now, bound=max_extra_wait):
        key = req.key
        if key in waiting or req.model.path in sim.reserved:
            if key in held:
                actions.held.append(req.id)  # its swap is held as the one ahead of it: its bound runs too
            continue  # an earlier request like it already waits (for a slot, a load, room)
        decided, holds = len(actions), len(actions.held)
        outcome = _plan_one(req, sim, machine, place, now, cooldowns, system_capacity, actions, load, queue)
        if outcome != "wait":
            queue.decided(req)
        if outcome == "wait" and len(actions) == decided:
            waiting.add(key)
            if len(actions.held) > holds:
                held.add(key)
    return actions


def fair_order(requests: Sequence[RequestView], *, now: float = 0.0, bound: float = 0.0) -> list[RequestView]:
    """Highest priority first; within a priority, by start tag (weighted fair order between
    tenants), ties in arrival order. One tenant: arrival order within a priority, as before.

    With a bound (``max_extra_wait`` > 0), priority is honest, not starvation: a request that
    has waited ``bound`` seconds is planned as if of the highest priority there is."""
    top = max((r.priority for r in requests), default=0)

    def priority(r: RequestView) -> int:
        return top if bound > 0 and now >= r.arrived + bound else r.priority

    if len({r.tenant for r in requests}) <= 1:
        return sorted(requests, key=lambda r: -priority(r))  # stable: arrival order within a priority
    return sorted(requests, key=lambda r: (-priority(r), r.share, r.id))


class FairShare:
    """Start-time fair queuing between tenants: each request gets a start tag when it arrives,
    ``max(now_virtual, its tenant's last finish)``, and its tenant's finish moves on by
    ``1 / weight``; the virtual clock is the largest tag dispatched so far. Requests served in
    tag order give each tenant with requests waiting a share of slots proportional to its
    weight, however many requests another tenant queues. Pure: the caller stamps and reports."""

    def __init__(self) -> None:
        self.virtual = 0.0
        self._finish: dict[str, float] = {}

    def arrive(self, tenant: str, weight: float) -> float:
        start = max(self.virtual, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + 1.0 / weight
        return start

    def dispatched(self, share: float) -> None:
        self.virtual = max(self.virtual, share)


RECENTLY_USED = 1.0  # seconds: a runner used this recently still holds a swap (within the bound)


class _Queue:
    """The waiting requests as the swap-aware rules see them during one pass: per model file,
    those not yet dispatched or failed in this pass, to tell whether a victim still has some."""

    def __init__(self, requests: Sequence[RequestView], bound: float, now: float) -> None:
        self.bound = bound
        self.now = now
        self.by_path: dict[str, dict[int, RequestView]] = defaultdict(dict)
        for r in requests:
            self.by_path[r.model.path][r.id] = r
        self.closed: dict[int, int] = {}

    def decided(self, req: RequestView) -> None:
        self.by_path[req.model.path].pop(req.id, None)

    def due(self, req: RequestView) -> bool:
        # the same sum as Plan.wake_at's: a wake-up at that time finds the request due
        return self.bound <= 0 or (req.held_since is not None and self.now >= req.held_since + self.bound)

    def victim_key(self, r: RunnerView) -> tuple[object, ...]:
        """Eviction order: idle first, nothing queued for it, lower priority, then as usual."""
        return (r.leases > 0, bool(self.by_path.get(r.model.path)), r.model.priority, *victim_order(r)[1:])

    def holding(self, victim: RunnerView, req: RequestView) -> float | None:
        """Until when ``victim`` holds ``req``'s swap (None: it does not): while it has queued
        requests to serve first (those before ``req`` always; later ones until ``req`` is due;
        ``inf``: until a change or ``req``'s due time), and, until ``req`` is due, while it is busy
        or was busy within the last :data:`RECENTLY_USED` seconds and its clients have come
        straight back before (``came_back``: clients that send their next request as soon as
        one is answered leave its queue empty between two; a runner used once, as when one
        client goes through several models in turn, holds nothing and the swap is a cold
        start)."""
        due = self.due(req)
        if any(
            (w.id < req.id or not due) and can_serve(victim, w.model, w.options)
            for w in self.by_path.get(victim.model.path, {}).values()
        ):
            return math.inf
        if due:
            return None
        if victim.leases > 0:
            return math.inf  # busy: its clients' next requests would follow it into a reload
        if not victim.came_back:
            return None
        recent = victim.last_used + min(self.bound, RECENTLY_USED)
        return recent if self.now < recent else None

    def owed(self, victim: RunnerView, req: RequestView) -> int:
        """How many requests that arrived before ``req`` still wait for ``victim``."""
        return sum(
            1 for w in self.by_path.get(victim.model.path, {}).values() if w.id < req.id and can_serve(victim, w.model, w.options)
        )

    def open_to(self, runner: RunnerView, req: RequestView) -> bool:
        return req.id < self.closed.get(runner.id, math.inf)

    def close(self, runner: RunnerView, req: RequestView) -> None:
        self.closed[runner.id] = min(self.closed.get(runner.id, req.id), req.id)


def _plan_one(
    req: RequestView,
    sim: _Sim,
    machine: Machine,
    place: Placer,
    now: float,
    cooldowns: Mapping[str, tuple[float, str]],
    system_capacity: int,
    actions: Plan,
    load: Callable[[RequestView, Placement], None],
    queue: _Queue | None = None,
) -> str:
    """Decide for one request; returns "wait" when it stays queued."""
    same_model = sim.same_model(req.model.path)
    usable = [r for r in same_model if not _leaving(r) and can_serve(r, req.model, req.options)]
    if usable:
        ready = [
            r
            for r in usable
            if r.state is RunnerState.READY and r.leases < r.slots and (queue is None or queue.open_to(r, req))
        ]
        if not ready:
            return "wait"  # joins the load, or waits for a free slot
        target = min(ready, key=lambda r: (r.leases, r.id))
        actions.append(Dispatch(req.id, target.id))
        sim.set(replace(target, leases=target.leases + 1, last_used=now))
        sim.touched.add(target.id)
        return "dispatched"
    # Too big even alone (e.g. a larger context than fits): fail now, before evicting a runner
    # of this model it would replace (the scheduler may then try a smaller automatic context,
    # which that runner may well serve).
    capacity = sim.capacity(place, req, system_capacity)
    if isinstance(capacity, DoesNotFit):
        error: TrioshedError = InsufficientMemory(
            req.model.name, capacity.needed, capacity.available, capacity.reason, num_ctx=req.options.num_ctx
        )
        if machine.remote_down and isinstance(
            sim.capacity(place, req, system_capacity, extra_gpus=machine.remote_down), Placement
        ):
            error = RemoteUnavailable(req.model.name, tuple(d.name or d.endpoint for d in machine.remote_down))
        actions.append(Fail(req.id, error))
        return "failed"
    if req.floor_estimate is not None and capacity.n_gpu_layers < gpu_layer_count(req.estimate):
        at_floor = sim.capacity(place, replace(req, floor_estimate=None, estimate=req.floor_estimate), system_capacity)
        if isinstance(at_floor, Placement) and at_floor.n_gpu_layers > capacity.n_gpu_layers:
            layers = gpu_layer_count(req.estimate)
            reason = f"would put {layers - capacity.n_gpu_layers} of {layers} layers in system memory"
            actions.append(Fail(req.id, SmallerContextPreferred(req.model.name, req.options.num_ctx, reason)))
            return "failed"
    if same_model:
        # An incompatible runner of this model (other options, adapters, a larger context):
        # reload it once its leases end. One runner per model file at a time, as in the
        # reference. A swap like any other: held while the runner serves the requests that fit
        # it (earlier ones always, later ones until this one is due; see the docstring).
        live = [r for r in same_model if not r.evicting and r.state is RunnerState.READY]
        if queue is not None and live:
            until = {r.id: queue.holding(r, req) for r in live}
            if any(t is not None for t in until.values()):
                actions.held.append(req.id)
                if queue.due(req):
                    for r in live:
                        queue.close(r, req)
                        actions.closed[r.id] = queue.closed[r.id]
                else:
                    since = req.held_since if req.held_since is not None else now
                    actions.wake_at = min(actions.wake_at, since + queue.bound, *(t for t in until.values() if t is not None))
                return "wait"
        for r in same_model:
            if not r.evicting and r.state is RunnerState.READY:
                why = "options changed" if same_files(r.model, req.model) else "model file changed"
                actions.append(Evict(r.id, f"reload: {why}"))
                sim.set(replace(r, evicting=True))
        return "wait"
    cooldown = cooldowns.get(req.model.path)
    if cooldown and cooldown[0] > now:
        actions.append(Fail(req.id, LoadCooldown(req.model.name, cooldown[0] - now, cooldown[1])))
        return "failed"
    # As in the reference: with other runners in the way, a model that would get fewer layers
    # on GPUs than it could alone makes room instead of spilling to the CPU.
    best_layers = capacity.n_gpu_layers
    chosen: list[RunnerView] = []  # victims evicted for this request

    def wait(reason: str, needed: tuple[tuple[str, int], ...], reserved: bool = False) -> str:
        victims = tuple(v.model.name for v in chosen) or sim.leaving()
        actions.waits.append(RoomWait(req.id, req.model.name, reason, needed, sim.free_now(), reserved, victims))
        return "wait"

    wanted = ((CPU_ID, req.estimate.total),)
    # Pinned runners are never victims: aim for what fits with every other runner gone, and
    # fail at once (not after evicting the others) when only evicting pinned ones makes room.
    pinned = sim.pinned()
    if pinned:
        others = sim.candidates()
        without_others = sim.fits_after(place, req, others)
        if without_others is not None:
            best_layers = min(best_layers, without_others.n_gpu_layers)
        elif sim.fits_after(place, req, others + pinned) is not None:
            if sim.unsettled or sim.reserved:  # decide once loads and evictions have settled
                return wait("only unloading pinned models would make room; deciding again once runners settle", wanted)
            names = tuple(sorted({r.model.name for r in pinned}))
            actions.append(Fail(req.id, PinnedModelsInTheWay(req.model.name, req.estimate.total, names)))
            return "failed"
    def loaded_now() -> Placement | DoesNotFit | None:
        """Load at once where memory free now (and after) and the runner count allow; returns
        the placement there is now when it does not (None when it loaded)."""
        fit_now = sim.place(place, req, projected=False)
        if (
            isinstance(fit_now, Placement)
            and fit_now.n_gpu_layers >= best_layers
            and sim.count(projected=False) < machine.max_loaded
        ):
            load(req, fit_now)
            return None
        return fit_now

    fit_now = loaded_now()
    if fit_now is None:
        return "loading"
    if req.floor_estimate is not None and sim.count(projected=False) < machine.max_loaded:
        # Not now, at its own size: where its smallest size fits beside the runners loaded now
        # (no eviction, no fewer GPU layers than that size gets alone), try the smaller sizes first.
        smaller = replace(req, floor_estimate=None, estimate=req.floor_estimate)
        alone = sim.capacity(place, smaller, system_capacity)
        beside = sim.place(place, smaller, projected=False)
        if isinstance(alone, Placement) and isinstance(beside, Placement) and beside.n_gpu_layers >= alone.n_gpu_layers:
            reason = "would not fit beside the models loaded now"
            actions.append(Fail(req.id, SmallerContextPreferred(req.model.name, req.options.num_ctx, reason)))
            return "failed"
    # Not now: make room. Victims in order (idle first, shortest keep-alive, least recently
    # used) until the request fits once they are gone; then drop any victim not needed.
    fit = sim.fits_after(place, req, chosen, best_layers)
    candidates = sim.candidates()
    if queue is not None and queue.bound > 0 and queue.due(req):
        # Due: the victims that owe the fewest earlier requests first, and a stable choice from
        # pass to pass (that count only falls), so that the ones it closes stay closed.
        candidates.sort(key=lambda v: (queue.owed(v, req), v.id))
    if fit is None:
        for victim in candidates:
            chosen.append(victim)
            fit = sim.fits_after(place, req, chosen, best_layers)
            if fit is not None:
                break
    if fit is not None:
        for victim in reversed(list(chosen)):
            without = [v for v in chosen if v is not victim]
            if sim.fits_after(place, req, without, best_layers) is not None:
                chosen = without
    if queue is not None and fit is not None and chosen:
        until = {v.id: queue.holding(v, req) for v in chosen}
        holding = [v for v in chosen if until[v.id] is not None]
        if holding:
            # Hold the swap: the victims serve their queued requests first (see the docstring).
            actions.held.append(req.id)
            busy = ", ".join(sorted({v.model.name for v in holding}))
            if queue.due(req):
                for v in chosen:
                    queue.close(v, req)
                    actions.closed[v.id] = queue.closed[v.id]
                return wait(f"{busy} first serves the requests queued before it, then is evicted", wanted)
            since = req.held_since if req.held_since is not None else now
            actions.wake_at = min(actions.wake_at, since + queue.bound, *(t for t in until.values() if t is not None))
            return wait(f"{busy} serves its queued requests first (at most {queue.bound:g}s more)", wanted)
    for victim in chosen:
        actions.append(Evict(victim.id, f"make room for {req.model.name}"))
        sim.set(replace(victim, evicting=True))
    if fit is not None and chosen and all(v.idle and _in_system_memory(v) for v in chosen):
        # Idle victims stop at once: where the request fits beside their exit (memory that is
        # free now and after, e.g. a swap forced by max_loaded), load without waiting for it.
        # Not for GPU victims: their freed memory is awaited (VRAM recovery) before a new load.
        if loaded_now() is None:
            return "loading"
    if fit is not None:
        usage = usage_of(sim.fits_after(place, req, [], best_layers) or fit)
        sim.reserve(req.model.path, usage)
        if chosen:
            return wait(f"evicting {', '.join(v.model.name for v in chosen)} to make room", usage, True)
        return wait("waiting for runners being unloaded to make room", usage, True)
    if sim.unsettled or sim.reserved:
        # runners still loading or leaving: decide again once they have
        reason = "memory reserved for earlier requests" if sim.reserved else "runners still loading or unloading"
        return wait(f"{reason}; deciding again once they settle", wanted)
    # Nothing of ours is left to make room: the memory is taken by something else. Take the
    # best placement there is now (partly or wholly on the CPU), or say why not.
    if isinstance(fit_now, Placement) and sim.count(projected=False) < machine.max_loaded:
        load(req, fit_now)
        return "loading"
    if isinstance(fit_now, DoesNotFit):
        reason = "the rest of the memory is in use by other programs"
        actions.append(Fail(req.id, InsufficientMemory(
            req.model.name, fit_now.needed, fit_now.available, reason, num_ctx=req.options.num_ctx
        )))  # fmt: skip
        return "failed"
    return wait(f"{machine.max_loaded} runners loaded (TRIOSHED_MAX_LOADED_MODELS) and none can be evicted", wanted)
