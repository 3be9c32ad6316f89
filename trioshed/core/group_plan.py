"""Adapter groups in the plan: a group that grows, a runner it supersedes, a group too large
for the memory (pure; :func:`trioshed.core.sched.plan` asks these).

A runner of an adapter group holds the adapters its group had when it loaded
(:mod:`trioshed.core.adapters`). A model added to the group since (created, pulled, a new
``models.toml`` entry) needs a runner with more adapters: the group *grows* (:func:`grows`); the
larger runner loads beside the old one where it fits, and once it is ready the old one is
*superseded* (:func:`superseded`): it takes no new request and stops once its requests end.
A group whose runner does not fit the memory at all is served by runners of fewer adapters:
each request's own (``RequestView.alone_estimate``): an adapter is dropped only under memory
pressure, and its models then swap as models without a group do. And an adapter set whose
sustained demand earns it (:mod:`trioshed.core.own_runner`) gets a runner of its own beside the
group's, where it fits without evicting anything (:func:`own_runner_for`): its requests go
there first (the runner with the fewest adapters that serves a request is chosen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trioshed.core.adapters import adapter_set, runner_model, selects
from trioshed.core.model import ModelSpec
from trioshed.core.own_runner import own_runner
from trioshed.core.views import (
    RequestView,
    RunnerState,
    RunnerView,
    can_serve,
    same_base,
    same_files,
)

__all__ = ["grows", "own_adapters_only", "own_runner_for", "reload_reason", "superseded"]


def grows(same_model: Sequence[RunnerView], req: RequestView) -> bool:
    """Whether every runner of ``req``'s model file left is an adapter group's runner that lacks
    ``req``'s adapters and would serve it with them (same base, options that fit)."""
    grown = runner_model(req.model, embedding=req.options.embedding)
    live = [r for r in same_model if not r.leaving]
    return bool(live) and all(
        selects(r.model) and not same_files(r.model, req.model) and can_serve(replace(r, model=grown), req.model, req.options)
        for r in live
    )


def superseded(runners: Sequence[RunnerView]) -> list[RunnerView]:
    """Ready adapter-group runners that another ready runner of the same base serves in full
    (all their adapters, options at least as large): a group that grew. They drain: no new
    lease, unloaded once their leases end."""
    ready = [r for r in runners if r.state is RunnerState.READY and not r.leaving and selects(r.model)]
    out = []
    for r in ready:
        if r.own:
            continue
        for q in ready:
            if q.id != r.id and same_base(q.model, r.model) and set(r.model.adapters) < set(q.model.adapters) and can_serve(q, r.model, r.options):
                out.append(r)
                break
    return out


def reload_reason(runner: ModelSpec, wanted: ModelSpec) -> str:
    """Why a runner of this model file is loaded again for ``wanted``."""
    if same_files(runner, wanted):
        return "options changed"
    if same_base(runner, wanted):
        return "adapters added to its group"
    return "model file changed"


def own_adapters_only(req: RequestView) -> RequestView:
    """``req`` planned for a runner of its model's own adapters only (its group's runner does
    not fit the memory at all)."""
    assert req.alone_estimate is not None
    own = runner_model(replace(req.model, group=()), embedding=req.options.embedding)
    return replace(req, estimate=req.alone_estimate, alone_estimate=None, floor_estimate=None, runner=own)


def own_runner_for(req: RequestView, usable: Sequence[RunnerView]) -> RequestView | None:
    """``req`` planned for a runner of its own adapter set, when its group's runner (in
    ``usable``, none with a free slot) says that set's demand earns one
    (:func:`trioshed.core.own_runner.own_runner`; the caller checks the room), and none is there
    or loading yet; else None."""
    if req.alone_estimate is None or not req.model.adapters:
        return None
    mine = set(req.model.adapters)
    if any(set(r.model.adapters) == mine for r in usable):
        return None  # it has one (or one is loading)
    group = next((r for r in usable if r.turns is not None and r.state is RunnerState.READY), None)
    if group is None or own_runner(group.demand, fits=True, load_seconds=group.load_seconds) != adapter_set(req.model):
        return None
    return own_adapters_only(req)
