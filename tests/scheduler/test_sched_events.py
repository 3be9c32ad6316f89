"""The scheduler's event history: what readers (/metrics, a status page) follow instead of a
callback. MockClock with fake runners; events in order with their reasons; refusals folded; a
reader waiting for the next event wakes on it; a waiter for a state wakes on a load begun and a
lease; the history is bounded."""

from __future__ import annotations

import trio
import trio.testing

from tests.scheduler.harness import running
from trioshed.errors import QueueFull
from trioshed.scheduler import EventHistory


async def test_loads_evictions_and_unloads_are_events_with_reasons(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2) as h:
        await h.once("a", keep_alive=600)
        await h.once("b", keep_alive=30)  # room for one: a is evicted
        await trio.sleep(31)  # b expires
        events = [(e.kind, e.model, e.reason) for e in h.sched.events.after(0)]
        assert events == [
            ("load", "a:latest", ""),
            ("ready", "a:latest", ""),
            ("evict", "a:latest", "make room for b:latest"),
            ("unloaded", "a:latest", "make room for b:latest"),
            ("load", "b:latest", ""),
            ("ready", "b:latest", ""),
            ("unloaded", "b:latest", "keep_alive expired"),
        ]
        ready = [e for e in h.sched.events.after(0) if e.kind == "ready"]
        assert [e.seconds for e in ready] == [2.0, 2.0]
        seqs = [e.seq for e in h.sched.events.after(0)]
        assert seqs == sorted(seqs) and h.sched.events.last_seq == seqs[-1]
        assert h.sched.events.after(seqs[2]) == h.sched.events.after(0)[3:]


async def test_crash_and_load_failure_are_events(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}) as h:
        release = trio.Event()
        await h.hold("a", release)
        h.factory.runner("a").crash(-9)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        h.factory.failing["b"] = "no such file"
        try:
            await h.once("b")
        except Exception:
            pass
        kinds = [(e.kind, e.model) for e in h.sched.events.after(0) if e.kind in ("crashed", "load failed", "refused")]
        assert kinds[:2] == [("crashed", "a:latest"), ("load failed", "b:latest")]
        failed = next(e for e in h.sched.events.after(0) if e.kind == "load failed")
        assert "no such file" in failed.reason


async def test_queue_full_refusals_fold_into_one_event(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}, max_queue=1, load_time=5) as h:
        got: list[str] = []
        h.want("a", got)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):
            try:
                await h.once("a")
            except QueueFull:
                pass
        refused = [e for e in h.sched.events.after(0) if e.kind == "refused"]
        assert [(e.model, e.status, e.reason, e.count) for e in refused] == [("a:latest", 503, "queue_full", 3)]
        await trio.sleep(6)
        assert got == ["a"]


async def test_a_reader_waiting_for_the_next_event_wakes_on_it(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}, load_time=3) as h:
        seen: list[str] = []

        async def reader() -> None:
            seq = h.sched.events.last_seq
            while len(seen) < 2:
                for e in await h.sched.events.wait_after(seq):
                    seen.append(e.kind)
                    seq = e.seq

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []
            await h.once("a")
        assert seen == ["load", "ready"]


async def test_a_waiter_for_the_state_wakes_on_a_load_begun_and_on_a_lease(autojump_clock: trio.testing.MockClock) -> None:
    # The waiter and the planner wake on the same change (the request queued), in an order Trio
    # varies from run to run: whichever runs first, the load the planner begins, and a lease
    # granted, wake the waiter again. Twenty rounds make an ordering that misses it all but sure.
    for _ in range(20):
        async with running({"a": 1}, load_time=1000) as h:
            got: list[str] = []
            start = trio.current_time()
            h.want("a", got)
            with trio.fail_after(10):
                stats = await h.sched.wait_statistics(lambda s: s.loading == 1 and s.queued == 1)
            assert stats.loaded == 0 and trio.current_time() - start < 10
            await trio.sleep(1000)
            release = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(h.hold, "a", release)
                with trio.fail_after(10):
                    await h.sched.wait_statistics(lambda s: s.leased == 1)
                release.set()
            assert got == ["a"]


def test_the_history_is_bounded_and_readers_get_the_oldest_held() -> None:
    history = EventHistory(size=3)
    for i in range(5):
        history.add("load", f"m{i}")
    assert [e.model for e in history.after(0)] == ["m2", "m3", "m4"]
    assert history.after(history.last_seq) == ()
    history.refused("m4", QueueFull())
    history.refused("m4", QueueFull())
    assert [(e.kind, e.count) for e in history.after(5)] == [("refused", 2)]


def test_the_history_costs_its_full_size_when_made_and_nothing_per_event() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        history = EventHistory(size=256)
        made = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/scheduler/events.py")])
        for i in range(256):  # full: each event now holds a place of its own
            history.add(("load", "ready", "unloaded")[i % 3], f"m{i % 4}:latest", "keep_alive expired", seconds=i / 7)
        full = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/scheduler/events.py")])
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in full.compare_to(made, "filename"))
    assert grown < 2048, f"{grown} bytes for 256 events held"  # an object per event: ~40 KB
    events = history.after(0)
    assert len(events) == 256 and events[-1].seconds == 255 / 7 and events[0].model == "m0:latest"
