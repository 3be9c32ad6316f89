"""Each adapter group's runner's demand per adapter set, fed to its meter by the planning pass.

What a set has on a runner at a moment: its requests running there (the leases of the runner's
members with that set) and those waiting that the runner could serve. The planning pass feeds
the counts to each group runner's :class:`~trioshed.core.own_runner.DemandMeter` whenever it
runs (a request arrives or leaves, a lease ends and no waiter took its slot directly, a load
ends...), so the meter holds the counts each pass saw until the next: between passes a slot
handed straight to the next waiter (``core.queue.hand_over``) changes little of them. The
planner reads the meters (``RunnerView.demand``) to decide whether a hot set gets a runner of
its own (:mod:`trioshed.core.own_runner`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from trioshed.core.adapter_turns import AdapterSet
from trioshed.core.adapters import adapter_set, selects
from trioshed.core.queue import Waiting
from trioshed.core.views import can_serve
from trioshed.scheduler.request import Request
from trioshed.scheduler.runner import Runner

__all__ = ["feed_demand"]


def feed_demand(runners: Iterable[Runner], waiting: Waiting[Request], now: float) -> None:
    """Give each adapter group's runner the counts per adapter set as they are at ``now``."""
    for r in runners:
        if not selects(r.model) or r.own:
            continue
        running: Counter[AdapterSet] = Counter()
        for m in r.members.values():
            if m.leases:
                running[adapter_set(m.model)] += m.leases
        queued: Counter[AdapterSet] = Counter()
        same = waiting.of_model(r.model.path)
        if same:
            view = r.view()
            for w in same.values():
                if can_serve(view, w.model, w.options):
                    queued[adapter_set(w.model)] += 1
        sets = set(running) | set(queued)
        r.meter.update(now, {s: (running[s], queued[s]) for s in sets}, r.options.num_parallel)
