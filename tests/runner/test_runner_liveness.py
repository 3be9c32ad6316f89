"""A runner is killed as hung only when it has neither answered a health check nor sent output
for the check's timeout, twice in a row: one slow ``/health`` on a saturated CPU kills nothing,
and the tokens a runner streams count as answers. A stream stalled past
TRIOSHED_STREAM_IDLE_TIMEOUT before any of its answer runs again on a new runner, like a death.
Simulated time, in-process fakes, the edge's own upstream code."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.api.pipeline import drain
from trioshed.api.pipeline.upstream import open_upstream_bytes, post_upstream_raw
from trioshed.core.model import RunnerOptions
from trioshed.errors import RunnerCrashed, RunnerStalled
from trioshed.scheduler import Lease
from trioshed.scheduler.lifetime import HEALTH_INTERVAL, HEALTH_TIMEOUT, PING_TIMEOUT

LONG = tuple(b"tok%d " % i for i in range(400))  # 200 s of tokens, 0.5 s apart
IDLE = 30.0  # TRIOSHED_STREAM_IDLE_TIMEOUT in these tests


@asynccontextmanager
async def idle_timeout(seconds: float) -> AsyncIterator[drain.RequestGuard]:
    """Bound each wait on the runner as the HTTP layer does for a request (``Drain``, with its
    watchdog for the reads of an answer)."""
    guards = drain.Drain(None, idle_timeout=seconds)  # type: ignore[arg-type]  # no app: its guard and watchdog only
    async with trio.open_nursery() as nursery:
        await nursery.start(guards.watch)
        guard = drain.RequestGuard(seconds, watched=True)
        guards._inflight.add(guard)
        token = drain._current.set(guard)
        try:
            yield guard
        finally:
            drain._current.reset(token)
            nursery.cancel_scope.cancel()


async def _stream(h, got: list[bytes], options: RunnerOptions | None = None) -> Lease:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(spec("a"), options or RunnerOptions()) as lease:
        async with open_upstream_bytes(lease, "/completion", {"prompt": "hi", "stream": True}) as pieces:
            async for piece in pieces:
                got.append(piece)
        return lease


async def _post(h, options: RunnerOptions | None = None) -> tuple[bytes, Lease]:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(spec("a"), options or RunnerOptions()) as lease:
        status, raw = await post_upstream_raw(lease, "/completion", {"prompt": "hi"})
        assert status == 200
        return raw, lease


async def test_a_runner_that_streams_tokens_is_alive_however_slow_its_health(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.answer, runner.health_time = LONG, math.inf  # /health never answers in time
        got: list[bytes] = []
        await _stream(h, got)  # 200 s: four times the monitor's two failed checks
        assert got == list(LONG) and not runner.exited and ("unhealthy", "a") not in h.record


async def test_a_request_waiting_beside_a_stream_does_not_get_it_killed(autojump_clock: trio.testing.MockClock) -> None:
    # The checks every PING_TIMEOUT while a request waits for its answer: the other slot's
    # tokens answer them.
    two = RunnerOptions(num_parallel=2)
    async with running({"a": 1}) as h:
        await h.once("a", options=two)
        runner = h.factory.runner("a")
        runner.answer, runner.health_time = LONG, math.inf
        got: list[bytes] = []
        async with trio.open_nursery() as n:
            n.start_soon(_stream, h, got, two)
            await runner.sent.wait()
            await trio.sleep(5)
            runner.head_time = 20.0  # the next request waits 20 s for its first byte
            later: list[bytes] = []
            lease = await _stream(h, later, two)
        assert got == list(LONG) and later == list(LONG) and lease.rerun_after is None
        assert not runner.exited and h.factory.started == 1


async def test_one_slow_health_check_while_a_request_waits_kills_nothing(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time, runner.health_time = 4 * PING_TIMEOUT, PING_TIMEOUT + 1
        async with trio.open_nursery() as n:
            got: list[tuple[bytes, Lease]] = []

            async def request() -> None:
                got.append(await _post(h))

            n.start_soon(request)
            await runner.sent.wait()
            # the first check (PING_TIMEOUT after the request went out) fails; the second,
            # right after it, is answered
            await trio.sleep(1.5 * PING_TIMEOUT)
            runner.health_time = 0.0
        [(raw, lease)] = got
        assert raw == b'{"content":"ok"}' and lease.rerun_after is None
        assert not runner.exited and ("unhealthy", "a") not in h.record


async def test_a_stream_on_a_runner_that_neither_answers_nor_streams_ends_within_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.answer = LONG
        got: list[bytes] = []
        async with trio.open_nursery() as n:
            errors: list[RunnerCrashed] = []

            async def stream() -> None:
                try:
                    await _stream(h, got)
                except RunnerCrashed as exc:
                    errors.append(exc)

            n.start_soon(stream)
            await trio.sleep(10)
            runner.frozen = True  # SIGSTOP: no token, no answer
            stopped = trio.current_time()
            await runner.wait_exited()
            assert trio.current_time() - stopped <= 2 * (HEALTH_INTERVAL + HEALTH_TIMEOUT) + 0.01
        assert got and len(got) < len(LONG)
        assert errors and "stopped answering" in errors[0].message and "nor sent output" in errors[0].message


async def test_a_stream_stalled_before_its_first_piece_runs_again_on_a_new_runner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        first = h.factory.runner("a")
        first.head_time = 10 * IDLE  # it answers its checks, and nothing else
        got: list[bytes] = []
        started = trio.current_time()
        async with idle_timeout(IDLE):
            lease = await _stream(h, got)
        # the head's wait ended by the watchdog at the bound (closing its connection), then a new
        # runner loaded (1 s) and answered (0.5 s)
        assert started + IDLE <= trio.current_time() <= started + IDLE + 1.5 + 0.01
        assert got == [b'{"content":"ok"}'] and lease.handle is not first
        assert isinstance(lease.rerun_after, RunnerStalled)
        assert h.factory.started == 2 and ("unloaded", "a") in h.record and first not in h.factory.live
        assert h.sched.statistics().leased == 0


async def test_a_stream_stalled_after_its_first_piece_ends_with_the_stall(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.answer, runner.piece_time = (b"one ", b"two"), 10 * IDLE
        got: list[bytes] = []
        started = trio.current_time()
        async with idle_timeout(IDLE) as guard:
            with pytest.raises(RunnerStalled):
                await _stream(h, got)
            # ended by the watchdog at the bound: the first piece came after 0.5 s
            assert started + 0.5 + IDLE <= trio.current_time() <= started + 0.5 + IDLE + 0.01
            assert guard.since is None and not guard._stalled
        assert got == [b"one "] and h.factory.started == 1


def test_a_second_failure_after_a_stall_names_both_with_its_own_status() -> None:
    stalled, crashed = RunnerStalled("m", 300), RunnerCrashed("m", -9)
    error = RunnerCrashed.again("m", stalled, crashed)
    assert "died twice" in error.message and "sent nothing for 300s" in error.message
    assert "exited too (code -9)" in error.message and error.status == 500
    assert RunnerCrashed.again("m", crashed, stalled).status == 504
