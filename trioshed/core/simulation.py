"""The machine as one planning pass has committed it so far: the room a new runner may take.

:func:`trioshed.core.sched.plan` decides request by request; each decision (a dispatch, a load,
an eviction, a reservation) changes what the next one may use. :class:`MachineSim` keeps that
account incrementally (usage per device, runners per model file, counts), so that one pass costs
about O(requests + runners) rather than their product, and answers the planner's questions:
where would this request fit now, once the pending evictions have settled, or once these victims
are gone; which runners are candidates to evict, in order. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

from trioshed.core.model import Device, DoesNotFit, Placement
from trioshed.core.views import (
    CPU_ID,
    Machine,
    Placer,
    RequestView,
    RunnerState,
    RunnerView,
    victim_order,
)


class MachineSim:
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
            if not r.leaving:
                self.used_kept[dev] += sign * b
            if r.state is RunnerState.LOADING:
                self.used_loading[dev] += sign * b
        if not r.leaving:
            self.kept += sign
        if r.leaving or r.state is not RunnerState.READY:
            self.unsettled += sign
        if r.leaving and r.leases == 0:
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
        return tuple(sorted({r.model.name for r in self.runners.values() if r.leaving}))

    def capacity(
        self, place: Placer, req: RequestView, system_capacity: int, extra_gpus: tuple[Device, ...] = ()
    ) -> Placement | DoesNotFit:
        gpus = tuple(replace(d, free=d.total) for d in (*self.machine.gpus, *extra_gpus))
        return self._place(place, req, gpus, system_capacity)

    def pinned(self) -> list[RunnerView]:
        if not self.any_pinned:
            return []
        return [r for r in self.runners.values() if r.pinned and not r.leaving]

    def candidates(self) -> list[RunnerView]:
        """Possible victims in eviction order (never pinned ones); sorted once a pass, runners
        leased meanwhile last."""
        if self._order is None:
            ready = [r for r in self.runners.values() if r.state is RunnerState.READY and not r.evicting and not r.pinned]
            self._order = [r.id for r in sorted(ready, key=self.victim_key)]
        live = [self.runners[i] for i in self._order if not self.runners[i].evicting]
        return [r for r in live if r.id not in self.touched] + [r for r in live if r.id in self.touched]
