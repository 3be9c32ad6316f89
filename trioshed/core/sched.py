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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from trioshed.core.adapter_turns import by_turns
from trioshed.core.adapters import runner_model
from trioshed.core.fairshare import fair_order
from trioshed.core.group_plan import (
    grows,
    own_adapters_only,
    own_runner_for,
    reload_reason,
    superseded,
)
from trioshed.core.model import DoesNotFit, ModelSpec, Placement
from trioshed.core.placement import gpu_layer_count
from trioshed.core.queue import SwapQueue
from trioshed.core.simulation import MachineSim
from trioshed.core.views import (
    CPU_ID,
    Machine,
    Placer,
    RequestView,
    RunnerState,
    RunnerView,
    can_serve,
    default_max_loaded,
    same_files,
    usage_of,
    victim_order,
)
from trioshed.errors import (
    InsufficientMemory,
    LoadCooldown,
    PinnedModelsInTheWay,
    RemoteUnavailable,
    SmallerContextPreferred,
    TrioshedError,
)

# The planner's vocabulary: its inputs (from trioshed.core.views), its actions, and plan().
__all__ = [
    "CPU_ID",
    "Action",
    "Dispatch",
    "Evict",
    "Fail",
    "Load",
    "Machine",
    "Placer",
    "Plan",
    "RequestView",
    "RoomWait",
    "RunnerState",
    "RunnerView",
    "can_serve",
    "default_max_loaded",
    "plan",
    "same_files",
    "usage_of",
    "victim_order",
]


@dataclass(frozen=True)
class Dispatch:
    request: int
    runner: int


@dataclass(frozen=True)
class Load:
    request: int
    placement: Placement
    #: the runner to start (None: the one :func:`~trioshed.core.adapters.runner_model` gives the
    #: request's model; a group too large for the memory: one with only the model's adapters)
    model: ModelSpec | None = None


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

    def describe(self) -> str:
        """What the log says of it: why, what it needs, what is free now, whom it waits for."""
        needed = "needs " + ", ".join(f"{_gib(b)} on {dev}" for dev, b in self.needed)
        free = "free now: " + ", ".join(f"{dev} {_gib(b)}" for dev, b in self.free)
        leaving = f"; waits for {', '.join(self.victims)} to unload" if self.victims else ""
        return f"waits for memory: {self.reason}; {needed} ({free}){leaving}"


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
    (:func:`~trioshed.core.fairshare.fair_order`, by the start tags ``FairShare`` gave them), so a tenant that floods
    the queue cannot push another's requests back by more than its share.
    """
    actions = Plan()
    queue = SwapQueue(requests, max_extra_wait, now)
    sim = MachineSim(machine, runners, queue.victim_key if max_extra_wait > 0 else None)
    cooldowns = cooldowns or {}
    system_capacity = sim.system_capacity()
    new_id = next_runner_id
    waiting: set[tuple[object, ...]] = set()  # requests like these already wait in this pass
    held: set[tuple[object, ...]] = set()  # ... and their swap is held

    def load(req: RequestView, placement: Placement) -> None:
        nonlocal new_id
        actions.append(Load(req.id, placement, req.runner))
        model = req.runner or runner_model(req.model, embedding=req.options.embedding)
        sim.add(RunnerView(new_id, model, req.options, RunnerState.LOADING, usage=usage_of(placement), last_used=now,
                           pinned=req.model.pinned, own=req.runner is not None))  # fmt: skip
        new_id -= 1

    for old in superseded(runners):
        actions.append(Evict(old.id, "its group grew: a runner with more adapters serves its models"))
        sim.set(replace(old, evicting=True))
    for req in by_turns(fair_order(requests, now=now, bound=max_extra_wait), runners):
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


def _plan_one(
    req: RequestView,
    sim: MachineSim,
    machine: Machine,
    place: Placer,
    now: float,
    cooldowns: Mapping[str, tuple[float, str]],
    system_capacity: int,
    actions: Plan,
    load: Callable[[RequestView, Placement], None],
    queue: SwapQueue | None = None,
) -> str:
    """Decide for one request; returns "wait" when it stays queued."""
    same_model = sim.same_model(req.model.path)
    usable = [r for r in same_model if not r.leaving and can_serve(r, req.model, req.options)]
    if usable:
        ready = [
            r
            for r in usable
            if r.state is RunnerState.READY and r.leases < r.slots and (queue is None or queue.open_to(r, req))
        ]
        if not ready:
            own = own_runner_for(req, usable)
            if own is not None:  # a hot adapter set: a runner of its own, where it fits now
                room = sim.place(place, own, projected=False)
                if isinstance(room, Placement) and sim.count(projected=False) < machine.max_loaded:
                    load(own, room)
                    return "loading"
            return "wait"  # joins the load, or waits for a free slot
        # the runner with the fewest adapters that serves it (a hot set's own before its group's)
        target = min(ready, key=lambda r: (len(r.model.adapters), r.leases, r.id))
        actions.append(Dispatch(req.id, target.id))
        sim.set(replace(target, leases=target.leases + 1, last_used=now))
        sim.touched.add(target.id)
        return "dispatched"
    # Too big even alone (e.g. a larger context than fits): fail now, before evicting a runner
    # of this model it would replace (the scheduler may then try a smaller automatic context,
    # which that runner may well serve).
    capacity = sim.capacity(place, req, system_capacity)
    if isinstance(capacity, DoesNotFit) and req.alone_estimate is not None:
        # the group's runner does not fit at all: a runner of this model's adapters only
        return _plan_one(own_adapters_only(req), sim, machine, place, now, cooldowns, system_capacity, actions, load, queue)
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
    if same_model and grows(same_model, req):
        # An adapter group that grows (a model whose adapters its runner lacks): the larger
        # runner loads beside it where it fits now, while the old one serves on; once ready it
        # takes the group's requests and the old one drains (:func:`~trioshed.core.group_plan.superseded`). Where it
        # does not fit, a swap like any other (below).
        beside = sim.place(place, req, projected=False)
        if isinstance(beside, Placement) and beside.n_gpu_layers >= capacity.n_gpu_layers and sim.count(projected=False) < machine.max_loaded:
            load(req, beside)
            return "loading"
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
                why = reload_reason(r.model, req.model)
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
    if fit is not None and chosen and all(v.idle and v.in_system_memory for v in chosen):
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


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
