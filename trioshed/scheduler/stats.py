"""The scheduler's frozen snapshot: what ``/metrics``, ``/api/ps`` and the tests read.

:func:`snapshot` assembles it from the scheduler's live state (its runners, waiting list, tenants
and counters) at one moment, given on Trio's clock and on the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from trioshed.core.admission import Tenant
from trioshed.core.model import MeasuredMemory, MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.queue import Waiting
from trioshed.core.views import CPU_ID, RunnerState
from trioshed.devices.rpc import RemoteDevices, RemoteStats
from trioshed.scheduler.contracts import Upstream
from trioshed.scheduler.request import Request
from trioshed.scheduler.runner import Member, Runner


@dataclass(frozen=True)
class MemberStats:
    """A model a runner serves that is warm (an adapter group's runner serves several)."""

    name: str
    leases: int
    #: wall-clock seconds (inf = never): it moves as time passes, so two snapshots of the
    #: same state compare equal without it
    expires_at: float = field(compare=False)
    adapters: tuple[str, ...] = ()  # its own adapters (files)
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)


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
    pinned: bool = False  # never evicted to make room (models.toml, or pinned for the session)
    spec: ModelSpec | None = None  # the model as the runner was loaded (its file, its store entry)
    #: Speculative decoding since the runner loaded: tokens drafted, and of those accepted.
    drafted: int = 0
    accepted: int = 0
    #: A word on its warm returns (a runner with a projector saves only text-only slots).
    warm_returns: str = ""
    # Its connection pool once ready, to observe it (GET /slots for /metrics), never to serve.
    upstream: Upstream | None = field(default=None, repr=False, compare=False)
    #: The models it serves that are warm, most recently used first (an adapter group's runner:
    #: its warm members; otherwise its model, once it served a request).
    members: tuple[MemberStats, ...] = ()
    #: The LoRA adapters it loaded, in ``--lora`` order (an adapter group's: the whole group).
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class QueueStats:
    """The requests waiting for one model (not yet holding a slot)."""

    model: str
    key: str  # whose requests ("" while trioshed has one API key or none)
    waiting: int
    since: float  # wall clock: when the oldest of them arrived


@dataclass(frozen=True)
class TenantStats:
    """One API key's requests now, by its name (never the key)."""

    key: str
    queued: int
    leased: int


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
    queue: tuple[QueueStats, ...] = ()  # waiting requests per model, in arrival order of the oldest
    tenants: tuple[TenantStats, ...] = ()  # per API key, when keys are configured


def runner_stats(r: Runner, *, waiting: int, now: float, wall: float) -> RunnerStats:
    """One runner's line: ``now`` on Trio's clock, ``wall`` the same moment on the wall clock."""
    view = r.view()
    if r.leases > 0 or r.state is RunnerState.LOADING:
        expires = math.inf if r.keep_alive == math.inf else wall + r.keep_alive
    else:
        expires = math.inf if r.timer.deadline == math.inf else wall + max(0.0, r.timer.deadline - now)
    usage = dict(view.usage)
    # The prompt cache's reservation (--cache-ram) is accounted in usage, shown apart in /api/ps
    # (runner.cache_ram): size stays the child's own buffers.
    size = max(0, sum(usage.values()) - max(0, r.options.cache_ram_mib) * 1024 * 1024)
    drafted, accepted = r.handle.speculation if r.handle is not None else (0, 0)
    return RunnerStats(
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
        size_vram=sum(usage.values()) - usage.get(CPU_ID, 0),
        context_length=r.options.num_ctx,
        load_duration=r.load_duration,
        placement=r.placement,
        estimate=r.estimate,
        measured=r.handle.measured if r.handle is not None else None,
        options=r.options,
        usage=view.usage,
        pinned=r.pinned,
        spec=r.model,
        drafted=drafted,
        warm_returns=r.handle.slots.note if r.handle is not None and r.handle.slots is not None else "",
        accepted=accepted,
        upstream=r.handle.upstream if r.handle is not None else None,
        members=tuple(_member(m, now, wall) for m in r.warm_members(now)),
        adapters=r.model.adapters,
    )


def _member(m: Member, now: float, wall: float) -> MemberStats:
    expires = math.inf if m.expires == math.inf else wall + max(0.0, m.expires - now)
    return MemberStats(m.model.name, m.leases, expires, m.model.adapters, m.model)


def snapshot(
    runners: Iterable[Runner],
    waiting: Waiting[Request],
    *,
    queued: int,
    tenants: Mapping[str, Tenant],
    counters: Mapping[str, int],
    remote: RemoteDevices | None,
    now: float,
    wall: float,
) -> SchedulerStatistics:
    """The scheduler's state now: ``queued`` counts the requests waiting and those not yet in
    the waiting list; ``counters`` are the totals since start (loads, unloads, crashes...)."""
    runners = list(runners)
    lines = [runner_stats(r, waiting=len(waiting.of_model(r.model.path)), now=now, wall=wall) for r in runners]
    states = [r.view().state for r in runners]
    remote_usage = {
        dev.removeprefix("rpc:"): (r.model.name, b)
        for r in runners
        for dev, b in r.usage()
        if dev.startswith("rpc:")
    }
    return SchedulerStatistics(
        queued=queued,
        leased=sum(r.leases for r in runners),
        loaded=states.count(RunnerState.READY),
        loading=states.count(RunnerState.LOADING),
        unloading=states.count(RunnerState.UNLOADING),
        runners=tuple(sorted(lines, key=lambda s: (s.expires_at, s.id))),
        queue=queue_stats(waiting),
        remote=remote.statistics(remote_usage) if remote is not None else (),
        tenants=tuple(TenantStats(name, t.queued, t.leased) for name, t in sorted(tenants.items()) if name),
        **counters,
    )


def queue_stats(waiting: Iterable[Request]) -> tuple[QueueStats, ...]:
    """The waiting requests per model, in arrival order of the oldest of each."""
    by_model: dict[str, QueueStats] = {}
    for req in waiting:  # arrival order: the first of each model is its oldest
        q = by_model.get(req.model.name)
        by_model[req.model.name] = QueueStats(req.model.name, "", 1, req.arrived) if q is None else replace(q, waiting=q.waiting + 1)
    return tuple(by_model.values())
