"""Properties of swap-aware dispatch (``plan(max_extra_wait=...)``), pure, with hypothesis
(derandomized: the same examples on every run).

A small discrete-event simulation drives ``plan()`` as the Trio scheduler does (plan after every
change and at ``Plan.wake_at``; a load takes ``load`` seconds, a lease ``serve`` seconds; room for
one runner), so the properties are about outcomes, not the planner's bookkeeping:

* the swap count of a burst is minimal up to the bound: requests arriving together over k models
  cost k loads once the bound covers the burst;
* no request waits longer than the bound beyond arrival order: a request that arrived after R,
  for another model, gets a slot before R only within ``max_extra_wait`` of the first pass that
  held R's swap (at 0: never);
* every request is served (no starvation, no deadlock).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trioshed.core.model import Device, ModelSpec, RunnerOptions
from trioshed.core.queue import RECENTLY_USED
from trioshed.core.sched import (
    Dispatch,
    Evict,
    Fail,
    Load,
    Machine,
    RequestView,
    RunnerState,
    RunnerView,
    plan,
)
from trioshed.testing.fake import fixed_estimator, simple_place

GiB = 1024**3
ESTIMATE = fixed_estimator({name: GiB for name in "abcd"})


@dataclass
class Outcome:
    loads: int = 0
    arrived: dict[int, float] = field(default_factory=dict)
    model: dict[int, str] = field(default_factory=dict)
    dispatched: dict[int, float] = field(default_factory=dict)
    held_since: dict[int, float] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)


def simulate(
    arrivals: list[tuple[float, str]], *, bound: float, slots: int, serve: float, load: float
) -> Outcome:
    """Requests (arrival time, model) in arrival order; returns what happened to each."""
    machine = Machine(gpus=(Device("cuda:0", "cuda", 0, 64 * GiB, 64 * GiB),),
                      system=Device("cpu", "cpu", 0, 64 * GiB, 64 * GiB), max_loaded=1)  # fmt: skip
    options = RunnerOptions(num_parallel=slots)
    out = Outcome()
    waiting: dict[int, RequestView] = {}
    runners: dict[int, RunnerView] = {}
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, id)
    seq = 0

    def at(t: float, kind: str, ident: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, ident))

    for i, (t, name) in enumerate(arrivals, start=1):
        out.arrived[i], out.model[i] = t, name
        at(t, "arrive", i)
    requests = {i: RequestView(i, ModelSpec(f"{n}:latest", f"/m/{n}.gguf"), options,
                               ESTIMATE(ModelSpec(f"{n}:latest", f"/m/{n}.gguf"), options))
                for i, (_, n) in enumerate(arrivals, start=1)}  # fmt: skip
    next_runner = 1000
    served: set[int] = set()
    wake = math.inf
    for _ in range(20_000):
        if not events and wake == math.inf:
            break
        if events and events[0][0] <= wake:
            now = events[0][0]
            while events and events[0][0] == now:  # everything at this instant, then one pass
                _, _, kind, ident = heapq.heappop(events)
                if kind == "arrive":
                    waiting[ident] = requests[ident]
                elif kind == "ready" and ident in runners:
                    runners[ident] = replace(runners[ident], state=RunnerState.READY)
                elif kind == "done":
                    r = runners[ident]
                    runners[ident] = r = replace(r, leases=r.leases - 1, last_used=now)
                    if r.evicting and r.leases == 0:
                        del runners[ident]
        else:
            now, wake = wake, math.inf
        if not waiting:
            continue
        views = [replace(v, held_since=out.held_since.get(v.id)) for v in waiting.values()]
        p = plan(views, list(runners.values()), machine, place=simple_place, now=now, next_runner_id=-1,
                 max_extra_wait=bound)  # fmt: skip
        created: dict[int, int] = {}
        for a in p:
            if isinstance(a, Load):
                next_runner += 1
                created[-(len(created) + 1)] = next_runner
                runners[next_runner] = RunnerView(next_runner, waiting[a.request].model, options, RunnerState.LOADING,
                                                  usage=(("cuda:0", GiB),), last_used=now)  # fmt: skip
                out.loads += 1
                at(now + load, "ready", next_runner)
            elif isinstance(a, Dispatch):
                rid = created.get(a.runner, a.runner)
                r = runners[rid]
                came_back = rid in served and (r.leases > 0 or now - r.last_used <= RECENTLY_USED)  # as the scheduler
                served.add(rid)
                runners[rid] = replace(r, leases=r.leases + 1, last_used=now, came_back=came_back)
                out.dispatched[a.request] = now
                del waiting[a.request]
                at(now + serve, "done", rid)
            elif isinstance(a, Evict):
                r = runners[a.runner]
                if r.leases == 0:
                    del runners[a.runner]
                else:
                    runners[a.runner] = replace(r, evicting=True)
            elif isinstance(a, Fail):
                out.failed.add(a.request)
                del waiting[a.request]
        if any(isinstance(a, Evict) for a in p):
            at(now, "evicted", 0)  # an idle victim stops at once: plan again at this instant
        for rid in p.held:
            out.held_since.setdefault(rid, now)
        assert p.wake_at > now  # a wake-up never finds nothing due (the scheduler would spin)
        wake = p.wake_at
    return out


names = st.sampled_from("abc")


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[tuple[float, str]], int, float, float]:
    n = draw(st.integers(1, 18))
    together = draw(st.booleans())
    times = sorted(0.0 if together else draw(st.integers(0, 40)) / 4 for _ in range(n))
    arrivals = [(t, draw(names)) for t in times]
    return arrivals, draw(st.integers(1, 3)), draw(st.sampled_from((0.5, 1.0, 2.0))), draw(st.sampled_from((1.0, 3.0)))


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
CYCLE = ([(0.0, "abc"[i % 3]) for i in range(24)], 2, 1.0, 2.0)  # the burst


@SETTINGS
@given(workloads(), st.sampled_from((0.0, 1.0, 3.0, 10.0)))
@example(CYCLE, 0.0)
@example(CYCLE, 5.0)
def test_no_request_waits_longer_than_the_bound_beyond_arrival_order(
    workload: tuple[list[tuple[float, str]], int, float, float], bound: float
) -> None:
    arrivals, slots, serve, load = workload
    out = simulate(arrivals, bound=bound, slots=slots, serve=serve, load=load)
    assert not out.failed
    assert set(out.dispatched) == set(out.arrived)  # everyone served
    for r, start in out.dispatched.items():
        for x, x_start in out.dispatched.items():
            if x > r and out.model[x] != out.model[r] and x_start < start:
                # x, later and for another model, went first: only while r's hold lasted
                assert r in out.held_since, (r, x, out)
                assert x_start <= out.held_since[r] + bound, (r, x, bound, out)


@SETTINGS
@given(st.lists(names, min_size=1, max_size=30), st.integers(1, 3), st.sampled_from((0.5, 1.0, 2.0)))
@example(list("abc" * 8), 2, 1.0)
def test_the_swap_count_of_a_burst_is_minimal_up_to_the_bound(models: list[str], slots: int, serve: float) -> None:
    arrivals = [(0.0, m) for m in models]
    span = len(models) * serve + 3 * len(set(models))  # the whole burst, one model at a time
    out = simulate(arrivals, bound=span, slots=slots, serve=serve, load=1.0)
    assert out.loads == len(set(models))
    # and arrival order at bound 0 costs at least as many
    assert simulate(arrivals, bound=0.0, slots=slots, serve=serve, load=1.0).loads >= out.loads


def test_a_request_is_due_exactly_at_its_wake_up_time() -> None:
    # 0.7 + 0.1 == 0.7999999999999999 but (0.7 + 0.1) - 0.7 < 0.1: a due test written as a
    # difference found the request not yet due at the very time Plan.wake_at named (measured: the
    # scheduler's timer then fired in a loop at that instant)
    held_since, bound = 0.7, 0.1
    out = simulate([(0.0, "a"), (0.0, "a"), (0.0, "b")], bound=bound, slots=1, serve=1.0, load=held_since)
    assert set(out.dispatched) == {1, 2, 3}
    machine = Machine(gpus=(), system=Device("cpu", "cpu", 0, 64 * GiB, 64 * GiB), max_loaded=1)
    options = RunnerOptions()
    a, b = (ModelSpec(f"{n}:latest", f"/m/{n}.gguf") for n in "ab")
    runner = RunnerView(1, a, options, RunnerState.READY, leases=1, usage=(("cpu", GiB),))
    waiting = [
        RequestView(2, b, options, ESTIMATE(b, options), held_since=held_since),
        RequestView(3, a, options, ESTIMATE(a, options)),
    ]
    p = plan(waiting, [runner], machine, place=simple_place, now=held_since + bound, max_extra_wait=bound)
    assert p.wake_at == math.inf and not p.held  # due: a is evicted, its later request waits
    assert [type(x).__name__ for x in p] == ["Evict"]
