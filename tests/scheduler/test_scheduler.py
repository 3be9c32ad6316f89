"""The scheduler loop with in-process fake runners and simulated time (autojump MockClock).

Each test asserts the exact order of events: the scheduler and the fake factory append to one
``record`` list ("load", "start", "ready", "dispatch", "evict", "stop", "unloaded", ...).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.scheduler.harness import GiB, Harness, running, spec
from trioshed.core.model import Device, RunnerOptions
from trioshed.devices import DeviceSource
from trioshed.errors import InsufficientMemory, LoadCooldown, LoadFailed, QueueFull, RunnerCrashed
from trioshed.scheduler import Lease, Scheduler
from trioshed.scheduler.scheduler import HEALTH_INTERVAL
from trioshed.testing.fake import FakeFactory, fixed_estimator, simple_place


async def test_same_model_twice_reuses_the_runner(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        first = await h.once("a")
        second = await h.once("a")
        assert h.factory.started == 1
        assert first.load_duration == pytest.approx(1.0)
        assert second.load_duration == 0.0
        assert h.events("load", "dispatch") == [("load", "a"), ("dispatch", "a"), ("dispatch", "a")]


async def test_changed_adapters_reload_after_the_first_lease_ends(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release = trio.Event()
        await h.hold("a", release)
        got: list[str] = []

        async def with_adapter() -> None:
            async with h.sched.acquire(spec("a", adapters=("/lora.gguf",)), RunnerOptions()) as lease:
                got.append(lease.model.adapters[0])

        h.nursery.start_soon(with_adapter)
        await trio.sleep(5)
        assert got == [] and h.factory.started == 1  # waits for the first lease
        release.set()
        await trio.sleep(5)
        assert got == ["/lora.gguf"]
        assert h.events("start", "stop", "dispatch", "evict") == [
            ("start", "a"), ("dispatch", "a"), ("evict", "a"), ("stop", "a"), ("start", "a"), ("dispatch", "a"),
        ]  # fmt: skip


async def test_changed_runner_options_reload_but_smaller_ctx_and_auto_gpu_do_not(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", options=RunnerOptions(num_ctx=8192))
        await h.once("a", options=RunnerOptions(num_ctx=2048))  # smaller: served (ollama#6148)
        await h.once("a", options=RunnerOptions(num_ctx=8192, num_gpu=-1))
        assert h.factory.started == 1
        await h.once("a", options=RunnerOptions(num_ctx=8192, num_batch=256))
        assert h.factory.started == 2


async def test_fourth_model_evicts_two_idle_first(autojump_clock: trio.testing.MockClock) -> None:
    # 24 GiB GPU; a, b, c take 8 each; d needs 16: two victims, the idle ones before the busy one.
    async with running({"a": 8, "b": 8, "c": 8, "d": 16}, max_loaded=4, system=4) as h:
        busy = trio.Event()
        await h.once("a")
        await h.hold("b", busy)
        await trio.sleep(1)
        await h.once("c")
        h.record.clear()
        await h.once("d")
        assert h.events("evict") == [("evict", "a"), ("evict", "c")]
        assert sorted(h.events("stop")) == [("stop", "a"), ("stop", "c")]
        assert h.events("stop", "start")[-1] == ("start", "d")  # after both victims are gone
        assert h.factory.runner("b")  # the busy one stayed
        busy.set()


async def test_max_loaded_models_evicts_shortest_keep_alive(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1, "c": 1}, max_loaded=2) as h:
        await h.once("a", keep_alive=600)
        await h.once("b", keep_alive=60)
        h.record.clear()
        await h.once("c")
        assert h.events("evict") == [("evict", "b")]
        assert sorted(r.model.short_name for r in h.factory.live) == ["a", "c"]


async def test_full_queue_answers_queue_full(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}, max_queue=1, load_time=10) as h:
        h.nursery.start_soon(h.once, "a")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull) as excinfo:
            await h.once("a")
        assert excinfo.value.status == 503 and excinfo.value.headers["Retry-After"]
        assert h.sched.statistics().rejected == 1


async def test_expiry_at_exactly_keep_alive(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=30)
        await trio.sleep(29.999)
        assert len(h.factory.live) == 1 and h.events("unloaded") == []
        await trio.sleep(0.002)
        assert h.factory.live == []
        assert h.events("unloaded") == [("unloaded", "a")]


async def test_new_request_resets_keep_alive_and_forever_means_forever(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=30)
        await trio.sleep(20)
        await h.once("a", keep_alive=math.inf)  # replaces the runner's keep-alive
        await trio.sleep(3600)
        assert len(h.factory.live) == 1
        assert h.sched.statistics().runners[0].expires_at == math.inf
        await h.once("a", keep_alive=0)  # 0: unload as soon as the last lease ends
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.1)
        assert h.factory.live == []


async def test_premature_or_duplicate_expiry_is_harmless(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release = trio.Event()
        await h.hold("a", release, keep_alive=10)
        await trio.sleep(60)  # leased: the timer does not run
        assert len(h.factory.live) == 1
        release.set()
        await trio.sleep(9)
        await h.once("a", keep_alive=10)  # a request just before expiry keeps it
        await trio.sleep(9)
        assert len(h.factory.live) == 1 and h.factory.started == 1
        await trio.sleep(2)
        assert h.factory.live == []


async def test_request_cancelled_while_queued_is_skipped_and_leaves_at_once(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, max_queue=1, load_time=10) as h:
        with trio.move_on_after(2):
            await h.once("a")
        assert h.sched.statistics().queued == 0  # left the queue at once: its slot is free
        b = await h.once("b")  # would be QueueFull if "a" still held the only slot
        assert b.model.short_name == "b"
        await trio.sleep(20)
        assert ("dispatch", "a") not in h.record
        assert ("left queue", "a") in h.record


async def test_shutdown_stops_every_runner(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}) as h:
        await h.once("a")
        await h.once("b", keep_alive=math.inf)
        assert len(h.factory.live) == 2
    assert sorted(h.events("stop")) == [("stop", "a"), ("stop", "b")]
    assert h.factory.live == []


async def test_no_head_of_line_blocking(autojump_clock: trio.testing.MockClock) -> None:
    # a (16) busy, b (4) loaded; c (16) must wait for a. Meanwhile requests for b go through.
    async with running({"a": 16, "b": 4, "c": 16}) as h:
        busy = trio.Event()
        await h.hold("a", busy)
        await h.once("b")
        waiting_c = trio.Event()

        async def want_c() -> None:
            async with h.sched.acquire(spec("c"), RunnerOptions()):
                waiting_c.set()

        h.nursery.start_soon(want_c)
        await trio.sleep(1)
        assert not waiting_c.is_set() and h.sched.statistics().queued == 1
        started = trio.current_time()
        for _ in range(3):
            await h.once("b")
        assert trio.current_time() - started < 0.01  # b served at once, c still waiting
        assert not waiting_c.is_set()
        busy.set()
        await waiting_c.wait()
        assert h.events("evict") == [("evict", "a")]


async def test_a_model_that_fits_now_loads_while_another_waits_for_a_swap(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # tiny (forever) and big (streaming) loaded; big2 waits for big's stream to end.
    # gamma fits now and beside big2 once big is gone: it loads at once, not after the swap.
    caplog.set_level("INFO", logger="trioshed.scheduler.scheduler")
    async with running({"tiny": 0.5, "big": 8, "big2": 8, "gamma": 1}, gpus=(0.5 + 8 + 4 + 0.6,), max_loaded=4) as h:
        await h.once("tiny", keep_alive=math.inf)
        stream = trio.Event()
        await h.hold("big", stream)
        got: list[str] = []
        h.want("big2", got)
        await trio.sleep(1)
        assert got == [] and h.events("evict") == [("evict", "big")]
        started = trio.current_time()
        with trio.fail_after(60):  # on the old planner, gamma waits for big's stream: forever here
            await h.once("gamma")
        assert trio.current_time() - started == pytest.approx(1.0)  # its own load time only
        assert got == [] and ("unloaded", "big") not in h.record  # big still streams
        stats = h.sched.statistics()
        assert stats.room_waits == 1  # big2; gamma never waited for room
        stream.set()
        await trio.sleep(5)
        assert got == ["big2"] and h.events("load") == [("load", n) for n in ("tiny", "big", "gamma", "big2")]
    waits = [r.getMessage() for r in caplog.records if "waits for memory" in r.getMessage()]
    assert waits == [
        "big2:latest waits for memory: evicting big:latest to make room; needs 8.00 GiB on cuda:0 "
        "(free now: cuda:0 4.60 GiB, cpu 4.00 GiB); waits for big:latest to unload"
    ]


async def test_a_freed_slot_goes_to_the_oldest_waiter_without_a_planning_pass(autojump_clock: trio.testing.MockClock) -> None:
    # One slot on a; 40 requests queue for it while c makes room (b is evicted for it).
    # Each release hands the slot to the next request for a, in arrival order, without a pass
    # over the queue: passes stay a handful however many requests are served.
    async with running({"a": 8, "b": 8, "c": 16}, max_queue=64) as h:
        first = trio.Event()
        await h.hold("a", first)
        await h.once("b")
        order: list[int] = []

        async def want_a(i: int) -> None:
            async with h.sched.acquire(spec("a"), RunnerOptions()):
                order.append(i)
                await trio.sleep(0.1)

        for i in range(40):
            h.nursery.start_soon(want_a, i)
            await trio.testing.wait_all_tasks_blocked()
        c_done = trio.Event()

        async def want_c() -> None:
            async with h.sched.acquire(spec("c"), RunnerOptions()):
                c_done.set()

        h.nursery.start_soon(want_c)
        await trio.testing.wait_all_tasks_blocked()
        before = h.sched.statistics().passes
        first.set()
        await c_done.wait()
        await h.sched.wait_statistics(lambda s: s.queued == 0 and s.leased == 0)
        assert order == list(range(40))
        assert h.sched.statistics().passes - before <= 6  # not one per request
        assert h.events("evict") == [("evict", "b")]


class _Steps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


async def test_a_request_on_a_free_slot_wakes_no_planning_pass(autojump_clock: trio.testing.MockClock) -> None:
    # Nothing waits: the lease takes the free slot at once, and its release has nothing for the
    # planner to decide, so the planner's task does not run at all (it ran once per release).
    async with running({"a": 8, "b": 8}) as h:
        await h.once("a")
        await trio.testing.wait_all_tasks_blocked()
        planner = _Steps("Scheduler.run")
        trio.lowlevel.add_instrument(planner)
        try:
            for _ in range(50):
                await h.once("a")
                await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(planner)
        assert planner.steps == 0
        assert h.sched.statistics().loaded == 1 and h.factory.started == 1
        # a request that must wait still gets its pass: b loads beside a
        await h.once("b")
        assert h.factory.started == 2


async def test_no_starvation_requests_for_a_victim_queue_behind_the_swap(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 16, "c": 16}) as h:
        busy = trio.Event()
        await h.hold("a", busy)
        order: list[str] = []
        h.want("c", order)
        await trio.testing.wait_all_tasks_blocked()
        h.want("a", order)  # must not extend a's life past c's swap
        await trio.sleep(1)
        assert order == []
        busy.set()
        await trio.sleep(10)
        assert order == ["c", "a"]
        assert h.events("start", "stop") == [("start", "a"), ("stop", "a"), ("start", "c"), ("stop", "c"), ("start", "a")]


async def test_crash_removes_runner_and_next_request_reloads(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release = trio.Event()
        lease = await h.hold("a", release)
        h.factory.runner("a").crash(-9)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(lease.crash, RunnerCrashed) and "-9" in lease.crash.message
        assert h.sched.statistics().runners == ()  # removed at once, lease still held
        again = await h.once("a")
        assert again.crash is None and h.factory.started == 2
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert h.sched.statistics().leased == 0 and h.sched.statistics().crashes == 1


async def test_model_too_big_fails_at_once_without_evicting(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 8, "huge": 100}, system=32) as h:
        await h.once("a")
        started = trio.current_time()
        with pytest.raises(InsufficientMemory) as excinfo:
            await h.once("huge")
        assert trio.current_time() == started
        assert excinfo.value.status == 507
        assert "100.00 GiB" in excinfo.value.message and "32.00 GiB" in excinfo.value.message
        assert h.events("evict") == [] and len(h.factory.live) == 1


async def test_loads_run_concurrently_and_a_second_request_joins_a_load(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, load_time=5) as h:
        started = trio.current_time()
        async with trio.open_nursery() as n:
            for name in ("a", "b", "a"):
                n.start_soon(h.once, name)
        assert trio.current_time() - started == pytest.approx(5)  # not 10: in parallel
        assert h.factory.started == 2
        assert sorted(h.events("start", "ready")[:2]) == [("start", "a"), ("start", "b")]


async def test_per_runner_slots_admit_num_parallel_leases(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release = trio.Event()
        options = RunnerOptions(num_parallel=2)
        await h.hold("a", release, options=options)
        await h.hold("a", release, options=options)
        third: list[Lease] = []

        async def want() -> None:
            async with h.sched.acquire(spec("a"), options) as lease:
                third.append(lease)

        h.nursery.start_soon(want)
        await trio.sleep(1)
        stats = h.sched.statistics()
        assert third == [] and stats.runners[0].leases == 2 and stats.runners[0].slots == 2
        assert stats.runners[0].waiting == 1 and stats.queued == 1
        release.set()
        await trio.sleep(1)
        assert len(third) == 1 and h.factory.started == 1


async def test_load_failure_reaches_the_request_then_cooldown_doubles(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"bad": 1}) as h:
        h.factory.failing["bad"] = "llama-server exited with code 1: failed to load model"
        with pytest.raises(LoadFailed, match="failed to load model"):
            await h.once("bad")
        assert h.sched.statistics().runners == ()
        with pytest.raises(LoadCooldown) as excinfo:
            await h.once("bad")
        assert excinfo.value.status == 503 and excinfo.value.headers["Retry-After"] == "10"
        await trio.sleep(10)
        with pytest.raises(LoadFailed):
            await h.once("bad")
        with pytest.raises(LoadCooldown) as excinfo:
            await h.once("bad")
        assert excinfo.value.headers["Retry-After"] == "20"  # doubled
        del h.factory.failing["bad"]
        await trio.sleep(20)
        assert (await h.once("bad")).model.short_name == "bad"
        assert h.factory.started == 3


async def test_statistics_and_no_leak_when_cancelled_at_every_point(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1}, load_time=3) as h:
        for delay in (0, 0.5, 2.9, 3.0, 3.5):
            with trio.move_on_after(delay):
                async with h.sched.acquire(spec("a"), RunnerOptions()):
                    await trio.sleep(1)
            await trio.testing.wait_all_tasks_blocked()
            stats = h.sched.statistics()
            assert stats.leased == 0 and stats.queued == 0, (delay, stats)


async def test_a_hung_runner_failing_health_checks_is_reloaded(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=math.inf)
        h.factory.runner("a").healthy = False
        await trio.sleep(HEALTH_INTERVAL * 2 + 1)
        assert h.factory.live == [] and ("unhealthy", "a") in h.record
        await h.once("a")
        assert h.factory.started == 2


class LaggingGpu(DeviceSource):
    """An NVML-like source reporting ``held`` bytes in use until the test clears it."""

    def __init__(self, total: float) -> None:
        super().__init__(
            (Device("cuda:0", "cuda", 0, int(total * GiB), int(total * GiB)),),
            "nvml",
            fixed_system=Device("cpu", "cpu", 0, 4 * GiB, 4 * GiB),
        )
        self.held = 0

    def poll(self) -> tuple[Device, ...]:
        return tuple(Device(d.id, d.library, d.index, d.total, d.total - self.held) for d in self.gpus)


@asynccontextmanager
async def lagging(total: float, sizes: dict[str, float], system: float = 4) -> AsyncIterator[tuple[Harness, LaggingGpu]]:
    record: list[tuple[str, str]] = []
    factory = FakeFactory(load_time=1, record=record)
    gpu = LaggingGpu(total)
    gpu.fixed_system = Device("cpu", "cpu", 0, int(system * GiB), int(system * GiB))
    sched = Scheduler(
        devices=gpu, factory=factory, estimator=fixed_estimator({k: int(v * GiB) for k, v in sizes.items()}),
        place=simple_place, record=record,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        yield Harness(sched, factory, record, nursery), gpu
        nursery.cancel_scope.cancel()


async def test_next_load_waits_for_freed_vram_to_show(autojump_clock: trio.testing.MockClock) -> None:
    async with lagging(24, {"a": 16, "b": 16}) as (h, gpu):
        await h.once("a")
        gpu.held = 16 * GiB  # what the GPU reports in use while "a" lives, and a while after
        start = trio.current_time()

        async def free_later() -> None:
            await trio.sleep(2.0)
            gpu.held = 0

        h.nursery.start_soon(free_later)
        await h.once("b")  # load time 1 s
        assert h.events("stop", "start")[-2:] == [("stop", "a"), ("start", "b")]
        # not before the memory showed as free, and soon after (250 ms polls)
        assert 2.0 <= trio.current_time() - start - 1.0 < 2.3


async def test_vram_recovery_gives_up_after_five_seconds(autojump_clock: trio.testing.MockClock) -> None:
    async with lagging(24, {"a": 16, "b": 16}, system=64) as (h, gpu):
        await h.once("a")
        gpu.held = 16 * GiB  # never shows as freed (another program took it, say)
        start = trio.current_time()
        lease = await h.once("b")
        # the recovery wait ended at its 5 s limit; with nothing of ours left to evict, b takes
        # the best placement there is now: system memory
        assert 5.0 <= trio.current_time() - start - 1.0 < 5.5
        assert h.sched.statistics().runners[0].placement.on_cpu_only and lease.model.short_name == "b"
