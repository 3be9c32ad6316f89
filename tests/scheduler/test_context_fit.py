"""Count-then-fit inside the scheduler: a prompt counted before or on its lease, never as a
request of its own.

The decisions are pure (``trioshed.core.fit``, plain tests first); the scheduler performs them
with in-process fake runners under simulated time, and a count function standing in for the
HTTP edge's (``/apply-template`` and ``/tokenize``). Counting on the model's loaded runner takes
no slot: the runner's keep-alive, its dispatches (where ``served`` and ``came_back`` change),
the key's requests and the request's trace are as they were, and the request queues once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import trio
import trio.testing

from tests.scheduler.harness import Harness, running, spec
from tests.scheduler.test_context_memory import OomFactory, scheduler, with_system_memory
from trioshed.core import fit
from trioshed.core.context import Shrunk
from trioshed.core.model import RunnerOptions
from trioshed.core.sched import RunnerState, RunnerView
from trioshed.errors import ContextOutOfMemory, ContextTooLong, UpstreamError
from trioshed.keys import ApiKey
from trioshed.runner.client import ConnectionFailed
from trioshed.scheduler import RunnerStats
from trioshed.scheduler.contracts import CountOn, PromptFit
from trioshed.scheduler.lifetime import PING_TIMEOUT
from trioshed.trace import RequestTrace
from trioshed.trace import current as current_trace

SMALL = RunnerOptions(num_ctx=4096)
ASKED = RunnerOptions(num_ctx=16384)  # an automatic size its bound asks for


def view(options: RunnerOptions) -> RunnerView:
    return RunnerView(1, spec("a"), options, RunnerState.READY, 0, False, 300.0, 0.0, ())


# -- the decisions ------------------------------------------------------------------------------


def test_a_larger_automatic_size_is_counted_on_the_loaded_runner_first() -> None:
    assert fit.count_first(view(SMALL), spec("a"), ASKED, True) == SMALL
    assert fit.count_first(view(SMALL), spec("a"), ASKED, False) is None  # num_ctx set: as set
    assert fit.count_first(view(ASKED), spec("a"), SMALL, True) is None  # it holds it already
    assert fit.count_first(None, spec("a"), ASKED, True) is None
    assert fit.count_first(view(RunnerOptions(num_ctx=4096, num_parallel=2)), spec("a"), ASKED, True) is None
    assert fit.count_first(view(SMALL), spec("b"), ASKED, True) is None  # another model's


def test_a_count_up_front_serves_there_grows_to_its_bucket_or_refuses() -> None:
    assert fit.sized_by_count(4000, ASKED, SMALL, 50) == fit.Sizing(SMALL, 0, 4096)
    assert fit.sized_by_count(4000, ASKED, SMALL, 100) == fit.Sizing(RunnerOptions(num_ctx=8192), 0, 8192)
    assert fit.sized_by_count(16000, ASKED, SMALL, 1000) == fit.Sizing(ASKED, 0, 16384)  # never past the size asked
    with pytest.raises(ContextTooLong) as e:
        fit.sized_by_count(16384, ASKED, SMALL, 0)
    assert (e.value.prompt_tokens, e.value.n_ctx) == (16384, 16384)
    assert fit.uncounted(ASKED, 20000, True) == fit.Sizing(ASKED, 20000, 4096)
    assert fit.uncounted(ASKED, 20000, False) == fit.Sizing(ASKED, 20000, 0)


def test_a_count_on_the_lease_serves_grows_or_says_why_not() -> None:
    assert not fit.must_count(4096, SMALL) and fit.must_count(4097, SMALL)
    spilled = Shrunk(asked=32768, tried=8192, why="would spill", fits_larger=True)
    assert fit.regrow_to(4095, SMALL, None, 0, spec("a")) is None
    assert fit.regrow_to(5000, SMALL, spilled, 0, spec("a")) == 8192
    assert fit.regrow_to(5000, SMALL, spilled, 4000, spec("a")) == 16384  # its output budget too
    with pytest.raises(ContextTooLong):
        fit.regrow_to(5000, SMALL, None, 0, spec("a"))
    with pytest.raises(ContextTooLong) as e:
        fit.regrow_to(40000, SMALL, spilled, 0, spec("a"))
    assert e.value.n_ctx == 32768  # the size asked for, not the smaller one
    with pytest.raises(ContextOutOfMemory):
        fit.regrow_to(5000, SMALL, Shrunk(32768, 8192, "out of memory"), 0, spec("a"))


# -- performed by the scheduler -----------------------------------------------------------------


def counting(tokens: int | Exception | None, seen: list[CountOn], check: Callable[[], None] = lambda: None,
             *, need: int = 8000, output: int = 0, automatic: bool = True) -> PromptFit:  # fmt: skip
    """A count that takes a second of simulated time (what it changed would show meanwhile),
    checks ``check()`` while it counts, and answers ``tokens``."""

    async def count(on: CountOn) -> int | None:
        seen.append(on)
        await trio.sleep(1)
        check()
        if isinstance(tokens, Exception):
            raise tokens
        return tokens

    return PromptFit(need, output, automatic, count)


def steady(r: RunnerStats) -> RunnerStats:
    """``r`` but for its expiry (given in wall-clock time: it moves as time passes)."""
    return replace(r, expires_at=0.0)


def dispatches(h: Harness) -> int:
    """How many leases were handed out (each one counts a runner's ``served``, ``came_back``)."""
    return len(h.events("dispatch"))


async def test_counting_on_the_loaded_runner_leaves_its_keep_alive_statistics_and_the_trace_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    alice = ApiKey("alice", "alice-secret-1", max_concurrent=1, max_queued=1)
    async with running({"a": 1}) as h:
        await h.once("a", options=SMALL, keep_alive=600)
        trace = RequestTrace("POST", "/api/generate", "test", 0.0)
        current_trace.set(trace)
        before, served, then = h.sched.statistics().runners, dispatches(h), trio.current_time()

        def unchanged() -> None:
            stats = h.sched.statistics()
            assert [steady(r) for r in stats.runners] == [steady(r) for r in before]
            # its expiry where it was (statistics give it in wall-clock time, here simulated)
            assert stats.runners[0].expires_at == pytest.approx(before[0].expires_at - (trio.current_time() - then), abs=0.5)
            assert stats.leased == 0 and stats.queued == 0
            assert dispatches(h) == served and stats.tenants == ()
            assert (trace.model, trace.queue_wait, trace.load_wait) == ("", None, None)

        seen: list[CountOn] = []
        async with h.sched.acquire(spec("a"), ASKED, 0, key=alice, fit=counting(4000, seen, unchanged)) as lease:
            assert lease.options == SMALL and lease.load_duration == 0  # served there, at once
            assert [on.options for on in seen] == [SMALL]
            assert dispatches(h) == served + 1  # one dispatch: the request's own
            assert (trace.model, trace.queue_wait, trace.load_wait) == ("a:latest", 0.0, 0.0)
            assert h.sched.statistics().runners[0].keep_alive == 0  # the request's keep-alive, from its lease
        await h.sched.wait_statistics(lambda s: not s.runners)  # keep_alive 0: unloaded after it, not before
        assert h.factory.started == 1 and h.sched.statistics().loads == 1


async def test_a_prompt_longer_than_the_model_takes_is_refused_without_a_lease_or_a_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", options=SMALL)
        trace = RequestTrace("POST", "/v1/messages", "test", 0.0)
        current_trace.set(trace)
        before, served = h.sched.statistics().runners, dispatches(h)
        with pytest.raises(ContextTooLong) as e:
            async with h.sched.acquire(spec("a"), ASKED, 0, fit=counting(20000, [])):
                raise AssertionError("leased")
        assert (e.value.prompt_tokens, e.value.n_ctx) == (20000, 16384)
        assert [steady(r) for r in h.sched.statistics().runners] == [steady(r) for r in before] and dispatches(h) == served and h.factory.started == 1
        assert trace.queue_wait is None


async def test_a_prompt_between_grows_the_context_to_the_bucket_of_its_count_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", options=SMALL)
        seen: list[CountOn] = []
        async with h.sched.acquire(spec("a"), ASKED, fit=counting(5000, seen, output=100)) as lease:
            assert lease.options.num_ctx == 8192 and lease.shrunk is None
        assert [on.options.num_ctx for on in seen] == [4096]  # counted once: not again on its lease
        assert h.factory.started == 2 and h.events("load", "dispatch")[-2:] == [("load", "a"), ("dispatch", "a")]


async def test_a_count_that_fails_leases_by_the_bound(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        await h.once("a", options=SMALL)
        seen: list[CountOn] = []
        async with h.sched.acquire(spec("a"), ASKED, fit=counting(UpstreamError("no"), seen, need=9000)) as lease:
            assert lease.options == ASKED  # its bound's size; its slot holds the bound: not counted again
        assert len(seen) == 1 and h.factory.started == 2


async def test_without_a_loaded_runner_the_prompt_is_counted_on_its_lease(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        seen: list[CountOn] = []
        with pytest.raises(ContextTooLong) as e:  # num_ctx set: never grown
            async with h.sched.acquire(spec("a"), SMALL, fit=counting(5000, seen, need=6000, automatic=False)):
                raise AssertionError("served")
        assert (e.value.prompt_tokens, e.value.n_ctx) == (5000, 4096)
        assert [on.options for on in seen] == [SMALL] and h.sched.statistics().leased == 0
        async with h.sched.acquire(spec("a"), SMALL, fit=counting(3000, seen, need=6000, automatic=False)) as lease:
            assert lease.options == SMALL
        async with h.sched.acquire(spec("a"), SMALL, fit=counting(None, seen, need=6000, automatic=False)) as lease:
            assert lease.options == SMALL  # not counted (media...): llama-server checks it
        async with h.sched.acquire(spec("a"), SMALL, fit=counting(9999, seen, need=4000, automatic=False)):
            pass  # its bound fits: never counted
        assert len(seen) == 3 and h.factory.started == 1


async def test_a_size_made_smaller_for_the_memory_grows_on_the_exact_count_or_is_a_507(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As tests/scheduler/test_context_memory.py's, with the count inside the scheduler: 32,768 would
    spill to system memory, 16,384 does not; then a GPU where only 8,192 loads."""
    factory = OomFactory(limit=10**9)
    async with with_system_memory(factory, gpu=6) as sched:
        seen: list[CountOn] = []
        wide = RunnerOptions(num_ctx=32768)
        async with sched.acquire(spec("a"), wide, fit=counting(10000, seen, need=30000)) as lease:
            assert lease.options.num_ctx == 16384 and lease.shrunk is not None  # it holds 10,000
        async with sched.acquire(spec("a"), wide, fit=counting(20000, seen, need=30000)) as lease:
            assert lease.options.num_ctx == 32768 and lease.shrunk is None  # grown: split, as it must
        assert [on.options.num_ctx for on in seen] == [16384, 16384]
        assert sched.statistics().leased == 0
    factory = OomFactory(limit=8192)
    async with scheduler(factory, gpu=64) as sched:
        with pytest.raises(ContextOutOfMemory):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), fit=counting(10000, [], need=30000)):
                raise AssertionError("served")
        assert factory.sizes == [32768, 16384, 8192] and sched.statistics().leased == 0


async def test_a_runner_that_hangs_while_it_counts_is_found_in_seconds(autojump_clock: trio.testing.MockClock) -> None:
    """Watched as a request waiting for its answer is: killed as hung, the count fails, and the
    request is leased by its bound on a new runner (not held for the stream's idle timeout)."""
    async with running({"a": 1}) as h:
        await h.once("a", options=SMALL)
        h.factory.runner("a").frozen = True

        async def count(on: CountOn) -> int | None:
            try:
                await on.upstream.post("/tokenize", b"{}")
            except ConnectionFailed:
                return None
            raise AssertionError("a frozen runner answered")

        started = trio.current_time()
        async with h.sched.acquire(spec("a"), ASKED, fit=PromptFit(8000, 0, True, count)) as lease:
            assert lease.options == ASKED
        # two checks of PING_TIMEOUT that fail in a row, the first PING_TIMEOUT after the count
        # went out; then a load (1 s)
        assert trio.current_time() - started <= 3 * PING_TIMEOUT + 1.0 + 0.01 and ("unhealthy", "a") in h.record


def test_a_num_ctx_set_smaller_than_its_runners_bounds_the_prompt() -> None:
    big, alias = RunnerOptions(num_ctx=32768), RunnerOptions(num_ctx=8192)
    assert fit.within(big, alias, False) == alias  # an alias's 8,192 on a 32,768 runner of its file
    assert fit.within(big, alias, True) == big  # an automatic size is only a bound: the whole slot
    assert fit.within(alias, alias, False) == alias and fit.within(alias, big, False) == alias
    assert fit.within(RunnerOptions(num_ctx=32768, num_parallel=4), alias, False) == alias  # (num_ctx is per slot)
    assert fit.must_count(9000, fit.within(big, alias, False)) and not fit.must_count(9000, big)
    with pytest.raises(ContextTooLong) as e:
        fit.regrow_to(25098, fit.within(big, alias, False), None, 0, spec("a"))
    assert (e.value.prompt_tokens, e.value.n_ctx) == (25098, 8192)
