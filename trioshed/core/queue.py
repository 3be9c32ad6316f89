"""The queue: the requests waiting for a runner, in order, and what they hold in a planning pass.

:class:`Waiting` is the scheduler's waiting list: arrival order (requests get increasing ids as
they arrive, and a request queued again goes back to its place), and the same per model file.
Two fast paths skip a planning pass where its answer is known, without breaking that order: a
request takes a free slot at once when nothing of its model waits ahead of it
(:func:`nothing_ahead`, :func:`free_runner`), and a slot just freed goes to the oldest request
of its model (:func:`hand_over`).

A swap costs a load, so the planner holds a swap while the runner it would evict still has
requests queued that it can serve (those that arrived first always; later ones within the bound,
``max_extra_wait``), or was just used by clients that come straight back (:data:`RECENTLY_USED`).
:class:`SwapQueue` answers those questions for :func:`trioshed.core.sched.plan` during one pass;
the rules themselves are drawn in :mod:`trioshed.core.sched`'s docstring. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

from trioshed.core.adapter_turns import set_of
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.core.views import RequestView, RunnerView, can_serve, victim_order


class Queued(Protocol):
    """A waiting request as the queue needs it: its id (arrival order), model and options."""

    @property
    def id(self) -> int: ...
    @property
    def model(self) -> ModelSpec: ...
    @property
    def options(self) -> RunnerOptions: ...


class Serving(Protocol):
    """A runner as the fast paths see it (:class:`trioshed.scheduler.runner.Runner`)."""

    @property
    def model(self) -> ModelSpec: ...
    @property
    def free_slot(self) -> bool: ...
    @property
    def closed_from(self) -> float: ...
    def view(self) -> RunnerView: ...


Q = TypeVar("Q", bound=Queued)
S = TypeVar("S", bound=Serving)
_NONE: Mapping[int, Any] = MappingProxyType({})


class Waiting(Generic[Q]):
    """The requests waiting for a runner: ``by_id`` in arrival order, and per model file."""

    def __init__(self) -> None:
        self.by_id: dict[int, Q] = {}
        self._by_path: dict[str, dict[int, Q]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Q]:
        return iter(self.by_id.values())

    def of_model(self, path: str) -> Mapping[int, Q]:
        """The requests waiting for the model file ``path``, oldest first (empty: none)."""
        return self._by_path.get(path, _NONE)

    def add(self, req: Q) -> None:
        """Queue ``req`` last (it arrived last)."""
        self.by_id[req.id] = req
        self._by_path.setdefault(req.model.path, {})[req.id] = req

    def add_in_order(self, req: Q) -> None:
        """Queue ``req`` (queued again: its id is older than most) in arrival order."""
        self.add(req)
        for waiting in (self.by_id, self._by_path[req.model.path]):
            if max(waiting) != req.id:  # others arrived after it (ids are given in arrival order)
                ordered = sorted(waiting.items())
                waiting.clear()
                waiting.update(ordered)

    def remove(self, req: Q) -> bool:
        """Take ``req`` out of the list; whether it was there."""
        if self.by_id.pop(req.id, None) is None:
            return False
        same = self._by_path[req.model.path]
        del same[req.id]
        if not same:
            del self._by_path[req.model.path]
        return True


def nothing_ahead(req: Queued, waiting: Waiting[Q], runners: Iterable[Serving]) -> bool:
    """No request for ``req``'s model waits that one of its runners could serve (one waiting
    for a reload, e.g. a larger context, does not hold back a request that fits the runner now;
    the runner's ``closed_from`` still bounds how long the swap waits)."""
    same = waiting.of_model(req.model.path)
    if not same:
        return True
    mine = [r for r in runners if r.model.path == req.model.path]
    return not any(can_serve(r.view(), w.model, w.options) for w in same.values() for r in mine)


def free_runner(req: Queued, runners: Iterable[S]) -> S | None:
    """A runner with a slot free now that serves ``req`` and is open to it (``closed_from``);
    of several (an adapter group's runner and a hot set's own), the one with the fewest adapters,
    as the planner chooses."""
    found: S | None = None
    for runner in runners:
        if (
            runner.model.path == req.model.path
            and runner.free_slot
            and req.id < runner.closed_from
            and can_serve(runner.view(), req.model, req.options)
        ):
            if not runner.model.adapters:
                return runner
            if found is None or len(runner.model.adapters) < len(found.model.adapters):
                found = runner
    return found


def hand_over(runner: Serving, waiting: Waiting[Q], tenants_waiting: Iterable[int]) -> Q | None:
    """The request a slot just freed on ``runner`` goes to without a planning pass, if any:
    what the planner would decide (a loaded, usable runner with a free slot takes its model's
    requests at once, oldest first). ``tenants_waiting``: each tenant's queued count (with
    several tenants waiting, whose turn it is, is the planner's fair order)."""
    same = waiting.of_model(runner.model.path)
    if not same or not runner.free_slot:
        return None
    if sum(1 for n in tenants_waiting if n) > 1:
        return None  # several tenants wait: whose turn it is, is the planner's fair order
    oldest = next(iter(same.values()))
    if oldest.id >= runner.closed_from:
        return None  # a request of another model, older than it, is due to evict this runner
    view = runner.view()
    if view.turns is not None:  # an adapter group's runner: its adapter sets take turns among
        # the requests it serves (the others wait for another runner: a larger group, their own)
        served = [w for w in same.values() if w.id < runner.closed_from and can_serve(view, w.model, w.options)]
        return view.turns.next(served, set_of, view.slots)
    if not can_serve(view, oldest.model, oldest.options):
        return None  # it waits for a reload: the planner decides
    return oldest


RECENTLY_USED = 1.0  # seconds: a runner used this recently still holds a swap (within the bound)


class SwapQueue:
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
