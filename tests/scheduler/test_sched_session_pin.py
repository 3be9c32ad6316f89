"""Scheduler.pin() (the status page's Pin/Unpin, ``POST /api/pin``) and the queue per model in
``statistics()``, with fake runners and simulated time."""

from __future__ import annotations

import math

import trio
import trio.testing

from tests.scheduler.harness import running, spec


async def test_a_session_pin_keeps_the_model_loaded_and_out_of_eviction_until_unpinned(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1, "c": 1}, max_loaded=2) as h:
        await h.once("a", keep_alive=60)
        await h.once("b", keep_alive=600)
        assert h.sched.pin(spec("a"), True) is True
        (a,) = [r for r in h.sched.statistics().runners if r.model == "a:latest"]
        assert a.pinned and a.keep_alive == math.inf and a.expires_at == math.inf
        await trio.sleep(120)  # past its own keep-alive of 60 s: still loaded
        h.record.clear()
        await h.once("c", keep_alive=3600)  # a would be the victim (shortest keep-alive) but is pinned
        assert h.events("evict") == [("evict", "b")]
        assert sorted(r.model.short_name for r in h.factory.live) == ["a", "c"]
        # unpinned: the default keep-alive counts down from now, and it may be a victim again
        assert h.sched.pin(spec("a"), False) is True
        (a,) = [r for r in h.sched.statistics().runners if r.model == "a:latest"]
        assert not a.pinned and a.keep_alive == 300
        await trio.sleep(300.001)
        assert sorted(r.model.short_name for r in h.factory.live) == ["c"]


async def test_a_pin_before_the_load_applies_when_it_loads(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        assert h.sched.pin(spec("a"), True) is False  # not loaded now
        await h.once("a")
        (a,) = h.sched.statistics().runners
        assert a.pinned and a.keep_alive == math.inf
        await h.once("a", keep_alive=5)  # a request's own keep_alive still wins, as in models.toml
        await trio.sleep(5.001)
        assert h.factory.live == []


async def test_statistics_count_waiting_requests_per_model_with_the_oldest_arrival(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, load_time=10) as h:
        got: list[str] = []
        for name in ("a", "b", "a"):
            h.want(name, got)
            await trio.testing.wait_all_tasks_blocked()
        stats = h.sched.statistics()
        # the loads started at once, so each request waits for its runner to be ready
        assert {q.model: q.waiting for q in stats.queue} == {"a:latest": 2, "b:latest": 1}
        assert all(q.key == "" and q.since > 0 for q in stats.queue)
        await h.sched.wait_statistics(lambda s: not s.queue)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(got) == ["a", "a", "b"]
