"""A runner's death is an event, not a race: a request whose runner died runs again once, on a
new runner, however late the scheduler's lifetime task sees the exit (a starved event loop), and
a runner whose child has exited is never handed to a request. Simulated time, in-process fakes
whose exit is seen ``exit_seen_after`` seconds late (far past any polling window)."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.api.pipeline.upstream import open_upstream_bytes, post_upstream_raw
from trioshed.core.model import RunnerOptions
from trioshed.core.views import RunnerState
from trioshed.errors import LoadFailed, RunnerCrashed
from trioshed.scheduler import Lease
from trioshed.testing.fake import FakeRunner

LATE = 60.0  # seconds before the lifetime task sees the exit: past any wait the edge might poll


async def _post(h, options: RunnerOptions | None = None) -> tuple[bytes, Lease]:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(spec("a"), options or RunnerOptions()) as lease:
        status, raw = await post_upstream_raw(lease, "/completion", {"prompt": "hi"})
        assert status == 200
        return raw, lease


async def test_a_death_seen_late_costs_one_rerun_on_a_new_runner(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=math.inf)
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        runner.exit_seen_after = LATE
        got: list[tuple[bytes, Lease]] = []
        async with trio.open_nursery() as n:

            async def request() -> None:
                got.append(await _post(h))

            n.start_soon(request)
            await runner.sent.wait()
            runner.crash(-11)
        [(raw, lease)] = got
        assert raw == b'{"content":"ok"}' and lease.handle is not runner
        assert lease.rerun_after is not None and "code -11" in lease.rerun_after.message
        assert "died twice" not in lease.rerun_after.message
        assert runner.requests == ["/completion"]  # the dead runner was never sent it again
        assert h.factory.started == 2 and h.record.count(("crashed", "a")) == 1
        stats = h.sched.statistics()
        assert stats.leased == 0 and stats.queued == 0 and stats.crashes == 1


async def test_a_runner_whose_child_exited_is_not_handed_out_before_the_scheduler_sees_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    two = RunnerOptions(num_parallel=2)
    async with running({"a": 1}) as h:
        release = trio.Event()
        held = await h.hold("a", release, options=two, keep_alive=math.inf)
        first: FakeRunner = h.factory.runner("a")
        first.exit_seen_after = LATE
        first.crash()
        raw, lease = await _post(h, two)  # its second slot is free, but its child is gone
        assert raw == b'{"content":"ok"}' and lease.handle is not first and lease.rerun_after is None
        assert first.requests == [] and h.factory.started == 2
        [dead] = [r for r in h.sched.statistics().runners if r.pid == first.pid] or [None]
        assert dead is None or dead.state == RunnerState.UNLOADING.value
        release.set()
        assert held.crash is None or "code -9" in held.crash.message
        await h.sched.wait_statistics(lambda s: s.crashes == 1 and s.leased == 0)


def test_the_planner_sees_a_runner_whose_child_exited_as_leaving() -> None:
    from trioshed.core.views import RunnerView

    view = RunnerView(1, spec("a"), RunnerOptions(), RunnerState.READY, exited=True)
    assert view.leaving and not RunnerView(1, spec("a"), RunnerOptions(), RunnerState.READY).leaving


async def test_a_request_run_again_never_goes_back_to_the_runner_it_left(autojump_clock: trio.testing.MockClock) -> None:
    # Lease.rerun marks its runner leaving before it gives the slot back: the request it is
    # queued again for cannot be handed the same runner (free, and "just used": no ping).
    async with running({"a": 1}) as h:
        async with h.sched.acquire(spec("a"), RunnerOptions()) as lease:
            first = lease.handle
            await lease.rerun(RunnerCrashed("a:latest", None, cause="a failure its child outlived"))
            assert lease.handle is not first and not first.exited
        assert h.factory.started == 2 and ("unloaded", "a") in h.record
        assert h.sched.statistics().leased == 0


async def test_a_stream_whose_replacement_fails_to_load_ends_with_the_load_error(autojump_clock: trio.testing.MockClock) -> None:
    # Past its status (a stream's headers are sent): the stream's error is the load's, not the crash's.
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        h.factory.failing["a"] = "the model file was replaced by something that is not a GGUF"
        async with trio.open_nursery() as n:
            n.start_soon(_crash_when_sent, runner)
            with pytest.raises(LoadFailed, match="not a GGUF"):
                async with h.sched.acquire(spec("a"), RunnerOptions()) as lease:
                    async with open_upstream_bytes(lease, "/completion", {"prompt": "hi", "stream": True}) as pieces:
                        async for _ in pieces:
                            raise AssertionError("a piece from a runner that died")
        assert h.sched.statistics().leased == 0


async def _crash_when_sent(runner: FakeRunner) -> None:
    await runner.sent.wait()
    runner.crash()
