"""Swap-aware dispatch with a bound (TRIOSHED_MAX_EXTRA_WAIT), through the Trio scheduler with
fake runners under MockClock: a loaded model serves its queue before it is evicted, a request is
never held past the bound, and the bound at 0 is arrival order (the policy before, Ollama's)."""

from __future__ import annotations

import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.core.model import RunnerOptions

TWO = RunnerOptions(num_parallel=2)
ONE = RunnerOptions(num_parallel=1)


async def burst(bound: float, n: int = 24, models: str = "abc", serve: float = 1.0) -> tuple[int, float, list[str]]:
    """n requests arriving together, cycling over ``models``, room for one runner with 2 slots;
    each holds its lease ``serve`` seconds. Returns (loads, time to the last answer, order served)."""
    async with running({m: 1 for m in models}, max_loaded=1, load_time=2, max_extra_wait=bound, max_queue=64) as h:
        served: list[str] = []
        start = trio.current_time()
        done = [0.0]

        async def one(name: str) -> None:
            async with h.sched.acquire(spec(name), TWO):
                served.append(name)
                await trio.sleep(serve)
            done[0] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, models[i % len(models)])
                await trio.testing.wait_all_tasks_blocked()  # arrival order = start order
        return h.sched.statistics().loads, done[0], served


async def test_a_burst_over_three_models_loads_each_once_by_default(autojump_clock: trio.testing.MockClock) -> None:
    loads, total, served = await burst(bound=60)
    assert loads == 3
    assert served == ["a"] * 8 + ["b"] * 8 + ["c"] * 8
    strict_loads, strict_total, _ = await burst(bound=0)
    assert strict_loads >= 12  # each swap serves one round of slots at best
    assert total < strict_total


async def flood(bound: float) -> tuple[float, list[str]]:
    """a is loaded, one request on it and one queued; b arrives at t=0.5; from t=1 a floods (a
    new request every 0.5 s, each holding the one slot 1 s). Returns b's wait and the order served."""
    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2, max_extra_wait=bound, max_queue=64) as h:
        await h.once("a", options=ONE)
        got_b: list[float] = []
        served: list[str] = []

        async def a_user() -> None:
            async with h.sched.acquire(spec("a"), ONE):
                served.append("a")
                await trio.sleep(1)

        async def b_user() -> None:
            t0 = trio.current_time()
            async with h.sched.acquire(spec("b"), ONE):
                served.append("b")
                got_b.append(trio.current_time() - t0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a_user)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(a_user)  # queued before b: served before b in any mode
            await trio.sleep(0.5)
            nursery.start_soon(b_user)
            await trio.sleep(0.5)
            for _ in range(60):
                if got_b:
                    break
                nursery.start_soon(a_user)
                await trio.sleep(0.5)
        assert got_b
        return got_b[0], served


async def test_the_bound_caps_how_long_a_swap_is_held(autojump_clock: trio.testing.MockClock) -> None:
    for bound in (0.0, 3.0, 10.0):
        waited, served = await flood(bound)
        # its turn: when the request queued before it has its slot (t=1, 0.5 s after it came);
        # then held ≤ bound, then the lease a holds ends (≤ 1 s) and b loads (2 s)
        assert bound <= waited <= 0.5 + bound + 1 + 2, (bound, waited)
        assert served[:2] == ["a", "a"]  # the one queued before b: served before b is loaded
        if bound == 0:
            assert served[2] == "b"  # arrival order: the flood after b waits
        else:
            assert served.count("a") >= 2 + bound  # held: a served its flood meanwhile


async def test_requests_queued_before_the_swap_are_served_first_even_past_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a loads with four requests waiting for it; b arrives after them; the bound (0.5 s) is
    # far shorter than serving them (4 s): a still serves them before it is evicted (arrival
    # order), but not the a request that arrives after b.
    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2, max_extra_wait=0.5) as h:
        served: list[str] = []

        async def user(name: str) -> None:
            async with h.sched.acquire(spec(name), ONE):
                served.append(name)
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            for name in ("a", "a", "a", "a", "b"):
                nursery.start_soon(user, name)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(3)  # a is ready and has served one; b's hold is past its bound
            nursery.start_soon(user, "a")
        assert served == ["a", "a", "a", "a", "b", "a"]
        assert h.sched.statistics().loads == 3


async def test_at_bound_0_a_swap_is_never_held(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2, max_extra_wait=0) as h:
        served: list[str] = []

        async def user(name: str) -> None:
            async with h.sched.acquire(spec(name), ONE):
                served.append(name)
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "a", "b"):
                nursery.start_soon(user, name)
                await trio.testing.wait_all_tasks_blocked()
        assert served == ["a", "b", "a", "b"]
        assert h.sched.statistics().loads == 4


async def test_a_held_request_says_why_it_waits(autojump_clock: trio.testing.MockClock, caplog: object) -> None:
    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2, max_extra_wait=5) as h:
        release = trio.Event()
        await h.hold("a", release, options=ONE)
        got: list[str] = []
        h.want("a", got)
        h.want("b", got)
        await trio.testing.wait_all_tasks_blocked()
        assert h.events("wait for room") == [("wait for room", "b")]
        release.set()
        await trio.sleep(10)
        assert got == ["a", "b"]


async def test_clients_that_come_straight_back_keep_their_model_within_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two clients send a's requests back to back (1 s each, 0.1 s between): between two of them
    # a has no lease and nothing queued. b arrives at t=0.5: a runner used within the last
    # second still holds the swap, up to the bound; arrival order swaps at the first gap.
    for bound, held in ((0.0, False), (5.0, True)):
        async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2, max_extra_wait=bound, max_queue=64) as h:
            await h.once("a", options=TWO)
            waited: list[float] = []

            async def a_client(stop: trio.Event) -> None:
                while not stop.is_set():
                    async with h.sched.acquire(spec("a"), TWO):
                        await trio.sleep(1)
                    await trio.sleep(0.1)

            async def b_user(stop: trio.Event, waited: list[float]) -> None:
                t0 = trio.current_time()
                async with h.sched.acquire(spec("b"), TWO):
                    waited.append(trio.current_time() - t0)
                stop.set()

            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a_client, stop)
                nursery.start_soon(a_client, stop)
                await trio.sleep(0.5)
                nursery.start_soon(b_user, stop, waited)
            if held:
                assert bound <= waited[0] <= bound + 1 + 2  # held to its bound, then a drains, b loads
            else:
                assert waited[0] <= 0.5 + 2  # swapped at the first gap (t=1)


async def test_a_client_going_through_models_in_turn_swaps_at_once(autojump_clock: trio.testing.MockClock) -> None:
    # One client, one model after another (room for one): a runner used once, whose clients
    # have not come straight back, holds no swap; its next model is a plain cold start (issue
    # 20: a 1 s hold made every such swap 1 s + the load). A client that does come straight
    # back is held for, as above.
    async with running({"a": 1, "b": 1, "c": 1}, max_loaded=1, load_time=2, max_extra_wait=5, max_queue=64) as h:
        waits = []
        for name in ("a", "b", "c", "a", "b"):
            t0 = trio.current_time()
            async with h.sched.acquire(spec(name), TWO):
                waits.append(trio.current_time() - t0)
            await trio.sleep(0.01)  # the client reads the answer and sends the next request
        assert waits == [2, 2, 2, 2, 2]  # each a load of 2 s, nothing more
        t0 = trio.current_time()
        for _ in range(2):  # now b's client comes straight back: b is held for it
            async with h.sched.acquire(spec("b"), TWO):
                pass
            await trio.sleep(0.01)
        async with h.sched.acquire(spec("c"), TWO):
            waited = trio.current_time() - t0
        assert waited >= 1 + 2  # held for RECENTLY_USED after b's last use, then c's load


async def test_priority_is_last_evicted_and_never_starves_below_the_bound(autojump_clock: trio.testing.MockClock) -> None:
    hi, lo = spec("hi", priority=5), spec("lo", priority=0)
    # last evicted: room for two, both idle, lo used last; c evicts lo all the same
    async with running({"hi": 1, "lo": 1, "c": 1}, max_loaded=2, load_time=1, max_extra_wait=5) as h:
        for model in (hi, lo):
            async with h.sched.acquire(model, ONE):
                pass
        await h.once("c")
        assert h.events("evict") == [("evict", "lo")]
    # never starved: three clients keep hi's one slot busy and its queue full; lo arrives at
    # t=0.5 and is planned after every hi request, until it has waited the bound
    async with running({"hi": 1, "lo": 1}, max_loaded=1, load_time=1, max_extra_wait=5, max_queue=64) as h:
        async with h.sched.acquire(hi, ONE):
            pass
        waited: list[float] = []

        async def hi_client(stop: trio.Event) -> None:
            while not stop.is_set():
                async with h.sched.acquire(hi, ONE):
                    await trio.sleep(1)

        async def lo_user(stop: trio.Event, waited: list[float]) -> None:
            t0 = trio.current_time()
            async with h.sched.acquire(lo, ONE):
                waited.append(trio.current_time() - t0)
            stop.set()

        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(hi_client, stop)
            await trio.sleep(0.5)
            nursery.start_soon(lo_user, stop, waited)
        assert 5 <= waited[0] <= 5 + 1 + 1 + 1  # the bound, hi's lease ends, lo loads (+ a pass's second)
