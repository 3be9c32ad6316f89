"""Pure planner tests for models.toml's ``pinned`` and ``priority`` (trioshed.core.sched)."""

from __future__ import annotations

from dataclasses import replace

from tests.core.test_sched_core import est, machine, model, req, run, runner
from trioshed.core.model import RunnerOptions
from trioshed.core.sched import Dispatch, Evict, Fail, Load, RequestView, RunnerState, RunnerView
from trioshed.errors import InsufficientMemory, PinnedModelsInTheWay

GiB = 1024**3


def pinned(view: RunnerView) -> RunnerView:
    return replace(view, pinned=True)


def preq(i: int, name: str, gib: float, priority: int) -> RequestView:
    return RequestView(i, model(name), RunnerOptions(), est(gib), priority=priority)


def test_a_pinned_runner_is_never_a_victim_the_next_in_order_is() -> None:
    # "old" would be the first victim (idle, shortest keep-alive, least recent) but is pinned.
    views = [pinned(runner(1, "old", 10, keep_alive=1, last_used=0)), runner(2, "other", 10, keep_alive=600, last_used=50)]
    actions = run([req(3, "new", 10)], views, machine(24))
    assert actions == [Evict(2, "make room for new:latest")]


def test_fitting_only_by_evicting_pinned_fails_at_once_with_507_and_evicts_nothing() -> None:
    views = [pinned(runner(1, "keep", 16)), runner(2, "other", 4)]
    actions = run([req(3, "new", 12)], views, machine(24, system=2))
    assert len(actions) == 1 and isinstance(actions[0], Fail)
    error = actions[0].error
    assert isinstance(error, PinnedModelsInTheWay) and isinstance(error, InsufficientMemory)
    assert error.status == 507 and error.pinned == ("keep:latest",)
    assert "pinned" in error.message and "'keep:latest'" in error.message and "'new:latest'" in error.message


def test_max_loaded_reached_by_pinned_runners_fails_rather_than_waiting_forever() -> None:
    views = [pinned(runner(1, "a", 1)), pinned(runner(2, "b", 1))]
    actions = run([req(3, "c", 1)], views, machine(24, max_loaded=2))
    assert len(actions) == 1 and isinstance(actions[0], Fail) and isinstance(actions[0].error, PinnedModelsInTheWay)
    assert actions[0].error.pinned == ("a:latest", "b:latest")
    # the same without pinning: an ordinary eviction
    assert run([req(3, "c", 1)], [runner(1, "a", 1), runner(2, "b", 1)], machine(24, max_loaded=2)) == [
        Evict(1, "make room for c:latest")
    ]


def test_pinned_decision_waits_while_runners_are_still_loading() -> None:
    views = [pinned(runner(1, "keep", 16)), runner(2, "loading", 4, state=RunnerState.LOADING)]
    assert run([req(3, "new", 12)], views, machine(24, system=2)) == []  # waits, evicts nothing
    settled = [views[0], replace(views[1], state=RunnerState.READY)]
    actions = run([req(3, "new", 12)], settled, machine(24, system=2))
    assert len(actions) == 1 and isinstance(actions[0], Fail) and isinstance(actions[0].error, PinnedModelsInTheWay)


def test_a_model_that_fits_beside_pinned_ones_only_on_the_cpu_loads_there_without_evicting() -> None:
    # The GPU is held by a pinned model: spilling to system memory is the best there is, so the
    # idle unpinned runner is not evicted for nothing.
    views = [pinned(runner(1, "keep", 20)), runner(2, "small", 1)]
    actions = run([req(3, "new", 6)], views, machine(24, system=8))
    assert len(actions) == 1 and isinstance(actions[0], Load) and actions[0].placement.on_cpu_only


def test_a_pinned_runner_still_serves_and_a_too_big_model_gets_the_plain_507() -> None:
    views = [pinned(runner(1, "keep", 4))]
    assert run([req(2, "keep")], views, machine(24)) == [Dispatch(2, 1)]
    actions = run([req(3, "huge", 100)], views, machine(24))
    assert isinstance(actions[0], Fail) and type(actions[0].error) is InsufficientMemory


def test_higher_priority_is_planned_first_when_both_wait_for_memory() -> None:
    views = [runner(1, "loaded", 20)]
    # "low" arrived first, but "high" gets the eviction and the reserved memory.
    actions = run([preq(2, "low", 16, 0), preq(3, "high", 16, 5)], views, machine(24, system=2))
    assert actions == [Evict(1, "make room for high:latest")]
    # equal priorities keep arrival order
    actions = run([preq(2, "low", 16, 5), preq(3, "high", 16, 5)], views, machine(24, system=2))
    assert actions == [Evict(1, "make room for low:latest")]


def test_priority_goes_first_to_free_memory_too() -> None:
    actions = run([preq(1, "low", 16, -1), preq(2, "high", 16, 0)], [], machine(24, system=2))
    assert [type(a) for a in actions] == [Load] and isinstance(actions[0], Load) and actions[0].request == 2


def test_pinning_does_not_stop_a_reload_of_the_same_file_with_other_runner_options() -> None:
    # One runner per model file (as in the reference): a request for the same file with other
    # runner options reloads it once its leases end, pinned or not (documented in docs/models.md).
    actions = run([req(2, "a", num_ctx=8192)], [pinned(runner(1, "a", 4))], machine(24))
    assert actions == [Evict(1, "reload: options changed")]
