"""No request is lost to a runner's death: a request whose runner died, hung, or was killed for
hanging before any of its answer was handed on runs again on a new runner (once); a second death
is an error naming both; a stream that had begun ends with the error. Simulated time, in-process
fake runners, the edge's own upstream code (every route's path to a runner)."""

from __future__ import annotations

import json
import math

import pytest
import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.api.pipeline.upstream import open_upstream_bytes, post_upstream_raw
from trioshed.core.model import RunnerOptions
from trioshed.errors import LoadCooldown, LoadFailed, RunnerCrashed
from trioshed.keys import ApiKey
from trioshed.scheduler import Lease
from trioshed.scheduler.lifetime import HEALTH_INTERVAL, PING_IDLE, PING_TIMEOUT
from trioshed.testing.fake import FakeRunner

PIECES = (b"one ", b"two ", b"three")


async def _post(h, name: str = "a", **kw: object) -> tuple[bytes, Lease]:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(spec(name), RunnerOptions(), **kw) as lease:
        status, raw = await post_upstream_raw(lease, "/completion", {"prompt": "hi"})
        assert status == 200
        return raw, lease


async def _stream(h, got: list[bytes], name: str = "a") -> Lease:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(spec(name), RunnerOptions()) as lease:
        async with open_upstream_bytes(lease, "/completion", {"prompt": "hi", "stream": True}) as pieces:
            async for piece in pieces:
                got.append(piece)
        return lease


def _answering(runner: FakeRunner) -> None:
    runner.answer = PIECES


@pytest.mark.parametrize("at", [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.4])
async def test_a_runner_that_dies_at_any_moment_before_the_whole_answer_is_read_costs_a_plain_answer_nothing(
    autojump_clock: trio.testing.MockClock, at: float
) -> None:
    # A whole (non-streamed) answer is handed on only once read to its end: a death at any
    # moment before (the head takes 0.5 s, then pieces 0.5 s apart) runs it again.
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        _answering(runner)
        async with trio.open_nursery() as n:
            got: list[tuple[bytes, Lease]] = []

            async def request() -> None:
                got.append(await _post(h))

            n.start_soon(request)
            await trio.sleep(at)
            runner.crash(-11)
        [(raw, lease)] = got
        assert raw == b'{"content":"ok"}'  # the new runner's answer (a fresh fake), whole
        # at 0 the death may come before the request is dispatched: the dead runner is then
        # never handed out, and nothing runs again
        assert (lease.rerun_after is not None and "code -11" in lease.rerun_after.message) or at == 0.0
        assert (h.factory.started == 2 and runner.requests == ["/completion"]) or at == 0.0
        assert h.sched.statistics().leased == 0 and h.sched.statistics().queued == 0


@pytest.mark.parametrize("at", [0.0, 0.25, 0.49])
async def test_a_stream_whose_runner_dies_before_its_first_piece_runs_again(
    autojump_clock: trio.testing.MockClock, at: float
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        _answering(runner)
        got: list[bytes] = []
        async with trio.open_nursery() as n:
            leases: list[Lease] = []

            async def request() -> None:
                leases.append(await _stream(h, got))

            n.start_soon(request)
            await trio.sleep(at)
            runner.crash()
        assert got == [b'{"content":"ok"}'] and h.factory.started == 2  # all of the new runner's answer
        # at 0 the death may come before the request is dispatched: the dead runner is then
        # never handed out, and nothing runs again
        assert leases[0].rerun_after is not None or at == 0.0


@pytest.mark.parametrize("at", [0.51, 0.75, 1.01, 1.25])  # the pieces come at 0.5, 1.0, 1.5
async def test_a_stream_whose_runner_dies_after_its_first_piece_ends_with_the_crash(
    autojump_clock: trio.testing.MockClock, at: float
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        _answering(runner)
        got: list[bytes] = []
        async with trio.open_nursery() as n:
            errors: list[RunnerCrashed] = []

            async def request() -> None:
                try:
                    await _stream(h, got)
                except RunnerCrashed as exc:
                    errors.append(exc)

            n.start_soon(request)
            await trio.sleep(at)
            runner.crash()
        assert got and got == list(PIECES[: len(got)]) and len(got) < len(PIECES)
        assert errors and "exited unexpectedly (code -9)" in errors[0].message
        assert h.factory.started == 1  # nothing ran again: the client had part of the answer
        await h.once("a")
        assert h.sched.statistics().leased == 0


async def test_a_runner_that_stops_after_its_ping_is_found_while_the_request_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The race the ping cannot close: the child stops just after answering it (a stopped
    # llama-server's busy threads were measured answering /health after SIGSTOP returned).
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=math.inf)
        runner = h.factory.runner("a")
        await trio.sleep(PING_IDLE + 1)  # the next request pings it first: it answers
        runner.head_time = 60.0
        async with trio.open_nursery() as n:
            got: list[tuple[bytes, Lease]] = []

            async def request() -> None:
                got.append(await _post(h))

            n.start_soon(request)
            await runner.sent.wait()
            runner.frozen = True  # stopped, with the request in it
            start = trio.current_time()
        [(raw, lease)] = got
        took = trio.current_time() - start
        # a check PING_TIMEOUT after the request went out, two of PING_TIMEOUT to fail in a row,
        # a load, the answer
        assert took <= 3 * PING_TIMEOUT + 1.0 + 0.5 + 0.01, took
        assert raw == b'{"content":"ok"}' and runner.returncode == -9
        assert lease.rerun_after is not None and "while a request waited for its answer" in lease.rerun_after.message
        assert ("unhealthy", "a") in h.record and h.factory.started == 2


async def test_a_runner_that_answers_its_checks_is_not_killed_however_long_the_answer_takes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 10 * HEALTH_INTERVAL  # a long generation: nothing until it is done
        raw, lease = await _post(h)
        assert raw == b'{"content":"ok"}' and lease.rerun_after is None and not runner.exited
        assert h.factory.started == 1


async def test_a_request_whose_second_runner_dies_too_gets_an_error_naming_both(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")

        async def kill_each_runner_that_is_sent_it() -> None:
            for code, loads in ((-9, 1), (-6, 2)):
                await h.sched.wait_statistics(lambda s, loads=loads: s.loads == loads and s.loaded == 1)  # type: ignore[misc]
                [runner] = [r for r in h.factory.live if not r.exited]
                await runner.sent.wait()
                runner.crash(code)

        async with trio.open_nursery() as n:
            n.start_soon(kill_each_runner_that_is_sent_it)
            with pytest.raises(RunnerCrashed) as caught:
                await _post(h)
        message = caught.value.message
        assert "died twice on this request" in message and "code -6" in message and "code -9" in message
        assert caught.value.status == 500 and h.factory.started == 2
        assert h.sched.statistics().leased == 0 and h.sched.statistics().queued == 0
        await h.once("a")  # the model still loads: a third runner serves the next request


async def test_a_request_run_again_goes_ahead_of_those_that_came_after_it(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        order: list[str] = []

        async def request(name: str) -> None:
            await _post(h)
            order.append(name)

        async with trio.open_nursery() as n:
            n.start_soon(request, "first")
            await runner.sent.wait()
            n.start_soon(request, "second")  # waits for the one slot
            await trio.sleep(1)
            assert h.sched.statistics().queued == 1
            runner.crash()
        assert order == ["first", "second"]


async def test_a_request_run_again_is_not_refused_by_a_full_queue_or_its_keys_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    key = ApiKey("k", "s", max_concurrent=2, max_queued=1)
    async with running({"a": 1}, max_queue=1) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        done: list[bytes] = []

        async def request() -> None:
            done.append((await _post(h, key=key))[0])

        async with trio.open_nursery() as n:
            n.start_soon(request)
            await runner.sent.wait()
            n.start_soon(request)  # fills the queue (1) and the key's queued (1)
            await trio.sleep(1)
            assert h.sched.statistics().queued == 1
            runner.crash()
        assert len(done) == 2 and h.factory.started == 2


async def test_a_client_that_leaves_while_its_request_waits_to_run_again_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}, load_time=30.0) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        with trio.move_on_after(10):  # the runner dies at 1 s; the new one needs 30 s to load
            async with trio.open_nursery() as n:
                n.start_soon(_post, h)
                await trio.sleep(1)
                runner.crash()
        stats = h.sched.statistics()
        assert stats.leased == 0 and stats.queued == 0
        assert sum(t.leased + t.queued for t in stats.tenants) == 0


async def test_a_replacement_that_fails_to_load_ends_the_request_with_the_load_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.head_time = 5.0
        h.factory.failing["a"] = "the model file was replaced by something that is not a GGUF"
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(_crash_soon, runner)
                with pytest.raises(LoadFailed, match="not a GGUF"):
                    await _post(h)
        assert h.sched.statistics().leased == 0


async def _crash_soon(runner: FakeRunner) -> None:
    await trio.sleep(1)
    runner.crash()


async def test_the_ping_and_the_monitor_finding_the_same_hung_runner_kill_it_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", keep_alive=math.inf)
        runner = h.factory.runner("a")
        # the next request's ping starts just before the monitor's regular check (the runner was
        # ready at 1.0, the load time): both wait on the stopped child
        await trio.sleep(1.0 + HEALTH_INTERVAL - 0.01 - trio.current_time())
        runner.frozen = True
        raw, lease = await _post(h)
        assert raw == b'{"content":"ok"}' and runner.returncode == -9
        assert h.record.count(("unhealthy", "a")) == 1 and h.factory.started == 2
        assert lease.rerun_after is None  # the ping caught it: the request never went to it


async def test_a_runner_killed_between_dispatch_and_send_runs_the_request_on_a_new_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        async with h.sched.acquire(spec("a"), RunnerOptions()) as lease:
            first = lease.handle
            first.crash()  # the monitor's kill, before the route sent anything
            status, raw = await post_upstream_raw(lease, "/completion", {"prompt": "x"})
            assert (status, json.loads(raw)) == (200, {"content": "ok"})
            assert lease.handle is not first and first.requests == []
        assert h.factory.started == 2 and h.sched.statistics().leased == 0


async def test_requests_waiting_for_a_load_whose_child_is_killed_wait_for_the_next_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # SIGKILL from outside (the OOM killer, an operator) while loading: not the model's fault.
    async with running({"a": 1}) as h:
        h.factory.killed_loading["a"] = 1
        got: list[str] = []
        for _ in range(3):
            h.want("a", got)
        await trio.sleep(10)  # two loads of 1 s
        assert got == ["a", "a", "a"] and h.factory.started == 2
        assert ("killed loading", "a") in h.record
        assert h.sched.statistics().load_failures == 1
        await h.once("a")  # no back-off (no LoadCooldown)


async def test_a_load_killed_twice_in_a_row_fails_its_requests_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        h.factory.killed_loading["a"] = 2
        with pytest.raises(LoadFailed, match=r"was killed \(code -9\) while loading, twice in a row"):
            await h.once("a")
        assert h.factory.started == 2
        h.factory.killed_loading["a"] = 1  # the count starts again after a success only
        with pytest.raises(LoadCooldown):
            await h.once("a")  # the back-off of a real failure
