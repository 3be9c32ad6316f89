"""A runner that dies under the count of a prompt (count-then-fit, on the request's lease) is a
runner failure before the answer: the request runs again on a new runner before its lease is
returned, so that a wait that fails then (a load that fails, shutdown) is raised by the lease
itself, and the route answers with that error and its status (its protocol's shape) instead of
a 200 that ends in "runner crashed". Simulated time, in-process fakes, the edge's own count."""

from __future__ import annotations

import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.api.pipeline.prompt_count import prompt_tokens
from trioshed.core.model import RunnerOptions
from trioshed.errors import LoadFailed, ShuttingDown
from trioshed.scheduler import Lease
from trioshed.scheduler.contracts import CountOn, PromptFit


async def _count(on: CountOn) -> int | None:
    # the edge's count (/tokenize); a fake's answer holds no tokens: counted as None
    return await prompt_tokens(on, "/completion", {"prompt": "hi"})


#: a bound larger than the slot holds: the request is counted on its lease
FIT = PromptFit(need=10**6, output=0, automatic=False, count=_count)


async def _lease_with_fit(h, got: list[Lease | Exception]) -> None:  # type: ignore[no-untyped-def]
    try:
        async with h.sched.acquire(spec("a"), RunnerOptions(), fit=FIT) as lease:
            got.append(lease)
    except Exception as exc:  # what the route would answer with
        got.append(exc)


async def _die_while_counting(h, then) -> Lease | Exception:  # type: ignore[no-untyped-def]
    """Lease with FIT; the runner dies while it counts; ``then()`` runs just before its death."""
    await h.once("a")
    runner = h.factory.runner("a")
    runner.head_time = 5.0
    got: list[Lease | Exception] = []
    async with trio.open_nursery() as n:
        n.start_soon(_lease_with_fit, h, got)
        await runner.sent.wait()
        assert runner.requests == ["/tokenize"]
        then()
        runner.crash(-11)
    [outcome] = got
    return outcome


async def test_a_runner_that_dies_under_the_count_runs_it_again_on_a_new_one(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        lease = await _die_while_counting(h, lambda: None)
        assert isinstance(lease, Lease) and lease.rerun_after is not None and "code -11" in lease.rerun_after.message
        assert h.factory.started == 2 and h.factory.runner("a").requests == ["/tokenize"]  # counted again
        assert h.sched.statistics().leased == 0


async def test_a_replacement_that_fails_to_load_is_the_leases_own_error(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:

        def broken() -> None:
            h.factory.failing["a"] = "the model file was replaced by something that is not a GGUF"

        error = await _die_while_counting(h, broken)
        assert isinstance(error, LoadFailed) and "not a GGUF" in error.message and error.status == 500
        stats = h.sched.statistics()
        assert stats.leased == 0 and stats.queued == 0


async def test_a_shutdown_while_it_waits_to_run_again_is_the_leases_own_error(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        error = await _die_while_counting(h, h.sched.close_queue)
        assert isinstance(error, ShuttingDown) and error.status == 503
        assert h.sched.statistics().leased == 0


async def test_a_count_refused_by_llama_server_is_no_count_and_no_rerun(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        runner = h.factory.runner("a")
        runner.answer = (b"not json",)  # the count's answer is an UpstreamError: no count
        got: list[Lease | Exception] = []
        await _lease_with_fit(h, got)
        [lease] = got
        assert isinstance(lease, Lease) and lease.rerun_after is None and h.factory.started == 1 and runner.requests == ["/tokenize"]


async def test_no_count_goes_to_a_runner_whose_child_exited(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a")
        first = h.factory.runner("a")
        first.exit_seen_after = 60.0  # the scheduler sees the exit late
        first.crash()
        got: list[Lease | Exception] = []
        await _lease_with_fit(h, got)
        [lease] = got
        assert isinstance(lease, Lease) and first.requests == [] and lease.handle is not first and lease.rerun_after is None
