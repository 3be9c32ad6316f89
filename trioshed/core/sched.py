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
* a model that cannot fit even with everything evicted fails at once (507), never an eviction loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from trioshed.core.model import (
    Device,
    DoesNotFit,
    MemoryEstimate,
    ModelSpec,
    Placement,
    RunnerOptions,
)
from trioshed.errors import InsufficientMemory, LoadCooldown, TrioshedError

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


@dataclass(frozen=True)
class Machine:
    """What the scheduler may use. ``gpus[i].free`` is the free memory the device *reports*
    (NVML) or its total (declared inventory); ``system`` is system memory (free = available)."""

    gpus: tuple[Device, ...]
    system: Device
    max_loaded: int
    overhead: int = 0
    spread: bool = False


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
Placer = Callable[..., Placement | DoesNotFit]


def default_max_loaded(configured: int, gpu_count: int) -> int:
    """TRIOSHED_MAX_LOADED_MODELS, where 0 means 3 per GPU (3 on CPU)."""
    return configured if configured > 0 else 3 * max(1, gpu_count)


def can_serve(runner: RunnerView, model: ModelSpec, options: RunnerOptions) -> bool:
    """Whether ``runner`` can serve a request without a reload.

    Same file, adapters and projector; equal runner options, except that ``num_gpu < 0`` (auto)
    never forces a reload and a smaller ``num_ctx`` is served by a larger runner (ollama#6148).
    """
    if (runner.model.path, runner.model.adapters, runner.model.projector) != (
        model.path,
        model.adapters,
        model.projector,
    ):
        return False
    have, want = runner.options, options
    if want.num_gpu < 0:
        want = replace(want, num_gpu=have.num_gpu)
    if want.num_ctx <= have.num_ctx:
        want = replace(want, num_ctx=have.num_ctx)
    return have == want


def victim_order(runner: RunnerView) -> tuple[bool, float, float, int]:
    """Sort key for eviction: idle first, then the shortest keep-alive, the least recently used."""
    return (runner.leases > 0, runner.keep_alive, runner.last_used, runner.id)


@dataclass
class _Sim:
    """The machine as this planning pass has committed it so far."""

    machine: Machine
    runners: list[RunnerView]
    reserved: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)  # model path -> usage

    def _used(self, device: str, *, including_evicting: bool) -> int:
        total = 0
        for r in self.runners:
            if r.evicting or r.state is RunnerState.UNLOADING:
                if not including_evicting:
                    continue
            total += dict(r.usage).get(device, 0)
        for usage in self.reserved.values():
            total += dict(usage).get(device, 0)
        return total

    def _devices(self, *, projected: bool) -> tuple[tuple[Device, ...], int]:
        """GPUs and system memory free for a new runner, now or once evictions complete."""
        gpus = []
        for d in self.machine.gpus:
            ours = self._used(d.id, including_evicting=not projected)
            released = 0 if not projected else self._used(d.id, including_evicting=True) - ours
            free = min(d.free + released, d.total - ours)
            gpus.append(replace(d, free=max(0, free)))
        s = self.machine.system
        ours = self._used(CPU_ID, including_evicting=not projected)
        released = 0 if not projected else self._used(CPU_ID, including_evicting=True) - ours
        system_free = max(0, min(s.free + released, s.total - ours))
        return tuple(gpus), system_free

    def count(self, *, projected: bool) -> int:
        present = [
            r for r in self.runners if not (projected and (r.evicting or r.state is RunnerState.UNLOADING))
        ]
        return len(present) + len(self.reserved)

    def place(self, place: Placer, req: RequestView, *, projected: bool) -> Placement | DoesNotFit:
        gpus, system_free = self._devices(projected=projected)
        return place(
            req.estimate,
            gpus,
            system_free=system_free,
            num_gpu=req.options.num_gpu,
            spread=self.machine.spread,
            overhead=self.machine.overhead,
        )

    def fits_after(
        self, place: Placer, req: RequestView, victims: Sequence[RunnerView], min_layers: int = 0
    ) -> Placement | None:
        """Where ``req`` would go once pending evictions and ``victims`` are gone, with at least
        ``min_layers`` layers on GPUs, if anywhere."""
        ids = {v.id for v in victims}
        saved = self.runners
        self.runners = [replace(r, evicting=True) if r.id in ids else r for r in saved]
        try:
            result = self.place(place, req, projected=True)
            ok = (
                isinstance(result, Placement)
                and result.n_gpu_layers >= min_layers
                and self.count(projected=True) < self.machine.max_loaded
            )
        finally:
            self.runners = saved
        return result if ok and isinstance(result, Placement) else None

    def capacity(self, place: Placer, req: RequestView, system_capacity: int) -> Placement | DoesNotFit:
        gpus = tuple(replace(d, free=d.total) for d in self.machine.gpus)
        return place(
            req.estimate,
            gpus,
            system_free=system_capacity,
            num_gpu=req.options.num_gpu,
            spread=self.machine.spread,
            overhead=self.machine.overhead,
        )


def usage_of(placement: Placement) -> tuple[tuple[str, int], ...]:
    usage = dict(placement.vram)
    if placement.ram:
        usage[CPU_ID] = usage.get(CPU_ID, 0) + placement.ram
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
) -> list[Action]:
    """Decide what to do for every waiting request, oldest first. Pure: no I/O, no clock.

    ``cooldowns`` maps a model path to (until, cause) after a failed load. Runners created by a
    ``Load`` in this pass are given ids counting down from ``next_runner_id`` so that later
    requests for the same model join them (the caller maps them to the runners it creates).
    """
    actions: list[Action] = []
    sim = _Sim(machine, list(runners))
    cooldowns = cooldowns or {}
    ours_cpu = sum(dict(r.usage).get(CPU_ID, 0) for r in runners)
    system_capacity = min(machine.system.total, machine.system.free + ours_cpu)
    new_id = next_runner_id

    def set_runner(view: RunnerView) -> None:
        sim.runners[:] = [view if r.id == view.id else r for r in sim.runners]

    for req in requests:
        if req.model.path in sim.reserved:
            continue  # an earlier request for this model already waits for room: join it
        same_model = [r for r in sim.runners if r.model.path == req.model.path]
        usable = [
            r
            for r in same_model
            if not r.evicting and r.state is not RunnerState.UNLOADING and can_serve(r, req.model, req.options)
        ]
        if usable:
            ready = [r for r in usable if r.state is RunnerState.READY and r.leases < r.slots]
            if ready:
                target = min(ready, key=lambda r: (r.leases, r.id))
                actions.append(Dispatch(req.id, target.id))
                set_runner(replace(target, leases=target.leases + 1, last_used=now))
            continue  # otherwise: joins the load, or waits for a free slot
        if same_model:
            # An incompatible runner of this model (other options, adapters): reload it once its
            # leases end. One runner per model file at a time, as in the reference.
            for r in same_model:
                if not r.evicting and r.state is RunnerState.READY:
                    actions.append(Evict(r.id, "reload: options changed"))
                    set_runner(replace(r, evicting=True))
            continue
        cooldown = cooldowns.get(req.model.path)
        if cooldown and cooldown[0] > now:
            actions.append(Fail(req.id, LoadCooldown(req.model.name, cooldown[0] - now, cooldown[1])))
            continue
        capacity = sim.capacity(place, req, system_capacity)
        if isinstance(capacity, DoesNotFit):
            actions.append(
                Fail(
                    req.id,
                    InsufficientMemory(req.model.name, capacity.needed, capacity.available, capacity.reason),
                )
            )
            continue
        # As in the reference: with other runners in the way, a model that would get fewer layers
        # on GPUs than it could alone makes room instead of spilling to the CPU.
        best_layers = capacity.n_gpu_layers
        fit_now = sim.place(place, req, projected=False)
        if (
            isinstance(fit_now, Placement)
            and fit_now.n_gpu_layers >= best_layers
            and sim.count(projected=False) < machine.max_loaded
        ):
            actions.append(Load(req.id, fit_now))
            sim.runners.append(
                RunnerView(
                    id=new_id,
                    model=req.model,
                    options=req.options,
                    state=RunnerState.LOADING,
                    usage=usage_of(fit_now),
                    last_used=now,
                )
            )
            new_id -= 1
            continue
        # Not now: make room. Victims in order (idle first, shortest keep-alive, least recently
        # used) until the request fits once they are gone; then drop any victim not needed.
        candidates = sorted(
            (r for r in sim.runners if r.state is RunnerState.READY and not r.evicting),
            key=victim_order,
        )
        chosen: list[RunnerView] = []
        fit = sim.fits_after(place, req, chosen, best_layers)
        for victim in candidates:
            if fit is not None:
                break
            chosen.append(victim)
            fit = sim.fits_after(place, req, chosen, best_layers)
        if fit is not None:
            for victim in reversed(list(chosen)):
                without = [v for v in chosen if v is not victim]
                if sim.fits_after(place, req, without, best_layers) is not None:
                    chosen = without
        for victim in chosen:
            actions.append(Evict(victim.id, f"make room for {req.model.name}"))
            set_runner(replace(victim, evicting=True))
        if fit is not None:
            sim.reserved[req.model.path] = usage_of(sim.fits_after(place, req, [], best_layers) or fit)
            continue
        if any(r.state is not RunnerState.READY or r.evicting for r in sim.runners) or sim.reserved:
            continue  # runners still loading or leaving: decide again once they have
        # Nothing of ours is left to make room: the memory is taken by something else. Take the
        # best placement there is now (partly or wholly on the CPU), or say why not.
        if isinstance(fit_now, Placement) and sim.count(projected=False) < machine.max_loaded:
            actions.append(Load(req.id, fit_now))
            sim.runners.append(
                RunnerView(new_id, req.model, req.options, RunnerState.LOADING, usage=usage_of(fit_now), last_used=now)
            )
            new_id -= 1
        elif isinstance(fit_now, DoesNotFit):
            reason = "the rest of the memory is in use by other programs"
            actions.append(Fail(req.id, InsufficientMemory(req.model.name, fit_now.needed, fit_now.available, reason)))
    return actions


def min_deadline(values: Sequence[float]) -> float:
    return min(values, default=math.inf)
