"""The status page's last hour, recent requests and models in reach, server side: the bounded
timeline and its sampler (MockClock, a stand-in scheduler), the recent-requests list, and the
three messages over a real server's event stream with a real runner."""

from __future__ import annotations

import itertools
import math
import tracemalloc
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.api.observe.test_ui import AUTH, KEY, messages
from trioshed.activity import RECENT, RecentRequests, protocol_of
from trioshed.core.model import MemoryEstimate, MiB, Placement, RunnerOptions
from trioshed.scheduler.events import TIMELINE, Timeline
from trioshed.scheduler.stats import QueueStats, RunnerStats, SchedulerStatistics
from trioshed.scheduler.timeline import PROMPT_CACHE, run_timeline, sample_of
from trioshed.testing.server import open_test_server
from trioshed.trace import RequestTrace


def test_tokens_of_a_request_are_spread_over_the_seconds_it_generated_them() -> None:
    timeline = Timeline()
    for second in range(100, 104):
        timeline.record(second, {}, [("cpu", "a", 10)])
    seq = timeline.last_seq
    timeline.add_tokens("a", 10, 101.2, 103.9)  # seconds 101, 102, 103: 4 + 3 + 3
    changed = timeline.after(seq)
    assert [(s.time, dict(s.tokens)) for s in changed] == [(101, {"a": 4}), (102, {"a": 3}), (103, {"a": 3})]
    assert all(s.seq > seq for s in changed)  # sent again: readers follow seq
    timeline.add_tokens("b", 2, 103.0, 105.5)  # 103 held; 104 and 105 not sampled yet: kept ahead
    timeline.record(104, {}, [("cpu", "a", 10)])
    timeline.record(105, {"a": 2}, [])
    held = {s.time: s for s in timeline.after(0)}
    assert dict(held[103].tokens) == {"a": 3, "b": 1} and dict(held[104].tokens) == {"b": 1}
    assert dict(held[105].waiting) == {"a": 2}
    assert sum(n for s in timeline.after(0) for _, n in s.tokens) == 12  # nothing lost, nothing twice


def test_the_timeline_is_bounded_and_says_idle_once() -> None:
    timeline = Timeline()
    for second in range(TIMELINE + 50):
        timeline.record(second, {}, [("cpu", "a", 1)])
    samples = timeline.after(0)
    assert len(samples) == TIMELINE and samples[0].time == 50
    timeline.add_tokens("a", 5, 0, 10)  # seconds no longer held: dropped, not kept forever
    assert timeline.after(samples[-1].seq) == ()
    timeline.record(TIMELINE + 50, {}, [])
    timeline.record(TIMELINE + 51, {}, [])
    timeline.record(TIMELINE + 52, {}, [])
    assert [s.idle for s in timeline.after(samples[-1].seq)] == [True]  # idle stays one sample
    for second in range(TIMELINE + 60, TIMELINE + 200):
        timeline.add_tokens("x", 1, second, second)  # ahead of any sample: bounded to a minute
    assert len(timeline._ahead) <= 140
    timeline.record(TIMELINE + 200, {}, [("cpu", "a", 1)])
    assert len(timeline._ahead) <= 61


def test_an_hour_of_samples_is_allocated_in_the_first_seconds() -> None:
    # The status page's hour must not grow for an hour: once its models and devices are known,
    # a sample costs nothing more, so a long soak's memory is flat from its first minute.
    timeline = Timeline()

    def busy(second: int) -> None:
        memory = [("cpu", "a" + PROMPT_CACHE, 8 * MiB), ("cpu", "a", 300 * MiB + second)]
        timeline.record(second, {"a": 1 + second % 3}, memory if second % 2 else [*memory, ("gpu0", "b", 1)])
        timeline.add_tokens("a", 7, second, second)

    for second in range(10):
        busy(second)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for second in range(10, TIMELINE + 600):
            busy(second)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4096
    samples = timeline.after(0)
    assert len(samples) == TIMELINE and samples[-1].time == TIMELINE + 599
    assert samples[-1].tokens == (("a", 7),) and samples[-1].waiting == (("a", 1 + (TIMELINE + 599) % 3),)
    assert samples[-1].memory == (("cpu", "a", 300 * MiB + TIMELINE + 599), ("cpu", "a" + PROMPT_CACHE, 8 * MiB))
    assert samples[-2].memory[-1] == ("gpu0", "b", 1)
    assert not hasattr(samples[0], "__dict__")  # slots: no per-sample dict


def test_a_column_that_holds_nothing_any_more_is_reused() -> None:
    timeline = Timeline(size=4)
    for second in range(4):
        timeline.record(second, {}, [("cpu", f"m{second}", 1)])
    assert len(timeline._columns) == 4
    for second in range(4, 12):
        timeline.record(second, {}, [("cpu", f"m{second}", 1)])  # a new model each second, an hour apart
    assert len(timeline._columns) == 4  # the evicted sample's column is the new one's: no more
    assert [s.memory for s in timeline.after(0)] == [(("cpu", f"m{t}", 1),) for t in range(8, 12)]


def _runner(model: str, usage: tuple[tuple[str, int], ...], cache_mib: int) -> RunnerStats:
    return RunnerStats(
        id=1, model=model, path="/m.gguf", state="ready", leases=0, slots=1, waiting=0, evicting=False, pid=1,
        keep_alive=math.inf, expires_at=math.inf, size=0, size_vram=0, context_length=512, load_duration=0.1,
        placement=Placement(n_gpu_layers=0), estimate=MemoryEstimate(weights=1, kv=0, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=()),
        measured=None, options=RunnerOptions(cache_ram_mib=cache_mib), usage=usage,
    )  # fmt: skip


def _stats(runners: tuple[RunnerStats, ...] = (), queue: tuple[QueueStats, ...] = ()) -> SchedulerStatistics:
    return SchedulerStatistics(queued=0, leased=0, loaded=len(runners), loading=0, unloading=0, runners=runners, loads=0,
                               unloads=0, crashes=0, load_failures=0, rejected=0, queue=queue)  # fmt: skip


def test_a_sample_names_the_prompt_cache_apart_and_counts_waiting_per_model() -> None:
    stats = _stats(
        (_runner("a", (("cuda:0", 300 * MiB), ("cpu", 1100 * MiB)), 1024), _runner("b", (("cpu", 50 * MiB),), 0)),
        (QueueStats("a", "alice", 2, 0.0), QueueStats("a", "bob", 1, 0.0), QueueStats("c", "", 4, 0.0)),
    )
    waiting, memory = sample_of(stats)
    assert waiting == {"a": 3, "c": 4}
    assert sorted(memory) == [
        ("cpu", "a", 76 * MiB), ("cpu", "a" + PROMPT_CACHE, 1024 * MiB), ("cpu", "b", 50 * MiB), ("cuda:0", "a", 300 * MiB),
    ]  # fmt: skip


class StandIn:
    """The two things the sampler reads from a scheduler."""

    def __init__(self) -> None:
        self.stats = _stats()
        self.changed = trio.Event()

    def statistics(self) -> SchedulerStatistics:
        return self.stats

    async def wait_changed(self) -> None:
        await self.changed.wait()

    def change(self, stats: SchedulerStatistics) -> None:
        self.stats = stats
        self.changed.set()
        self.changed = trio.Event()


async def test_the_sampler_records_each_second_while_busy_and_sleeps_while_idle(autojump_clock: trio.abc.Clock) -> None:
    scheduler, timeline = StandIn(), Timeline()
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_timeline(scheduler, timeline, clock=trio.current_time, task_status=task_status))  # type: ignore[arg-type]
        await trio.sleep(100)  # idle: one sample, then no wake-ups
        assert [s.idle for s in timeline.after(0)] == [True]
        scheduler.change(_stats((_runner("a", (("cpu", 10),), 0),)))
        await trio.sleep(10.5)
        busy = timeline.after(1)
        assert len(busy) in (10, 11) and all(dict((d, n) for d, _, n in s.memory) == {"cpu": 10} for s in busy)
        assert [b.time - a.time for a, b in itertools.pairwise(busy)] == [1] * (len(busy) - 1)
        scheduler.change(_stats())
        await trio.sleep(1.5)  # the sampler sees the change at its next second: one idle sample
        last = timeline.last_seq
        await trio.sleep(500)
        assert timeline.last_seq == last and timeline.after(0)[-1].idle
        nursery.cancel_scope.cancel()


def _trace(path: str, **fields: Any) -> RequestTrace:
    return replace(RequestTrace("POST", path, "127.0.0.1:1", 0.0, route=path, status=200), **fields)


def test_recent_requests_say_why_one_was_slow_and_stay_bounded() -> None:
    recent = RecentRequests()
    assert recent.add(_trace("/metrics", route="/metrics"), 0.01) is None  # names no model: not listed
    loaded = recent.add(_trace("/api/chat", model="m", queue_wait=2.5, load_wait=2.0, prompt_tokens=10, eval_tokens=20,
                               prompt_seconds=0.25, eval_seconds=0.5, key="alice"), 3.0)  # fmt: skip
    assert loaded is not None and loaded.protocol == "ollama" and loaded.key == "alice"
    assert loaded.ttft == pytest.approx(2.75) and loaded.tokens_per_second == pytest.approx(40)
    assert loaded.slow == "waited 2.0 s for a load; waited 500 ms in the queue"
    queued = recent.add(_trace("/v1/messages", model="m", queue_wait=3.0, load_wait=0.0, restore_seconds=0.012), 4.0)
    assert queued is not None and queued.protocol == "anthropic"
    assert queued.slow == "waited 3.0 s in the queue; restored a saved conversation in 12 ms"
    refused = recent.add(_trace("/v1/chat/completions", status=503, error="queue_full"), 0.0)
    assert refused is not None and refused.model == "" and refused.slow == "refused: queue_full"
    assert [r.seq for r in recent.after(1)] == [2, 3]
    for _ in range(RECENT + 10):
        recent.add(_trace("/api/generate", model="m"), 0.1)
    assert len(recent.after(0)) == RECENT
    assert protocol_of("/v1/responses") == "openai" and protocol_of("/api/embed") == "ollama"


def test_recent_requests_come_back_as_they_were_added_and_cost_nothing_per_request_once_made() -> None:
    import tracemalloc

    recent = RecentRequests(size=128)
    added = [
        recent.add(_trace("/api/chat", model="m", queue_wait=2.5, load_wait=2.0, prompt_tokens=10, eval_tokens=0,
                          prompt_seconds=0.25, eval_seconds=0.5, key="alice"), 3.0),
        recent.add(_trace("/v1/chat/completions", status=0), 0.0),  # no model, no timings: None stays None
    ]  # fmt: skip
    assert recent.after(0) == tuple(added)
    tracemalloc.start()
    try:
        made = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/activity.py")])
        for i in range(128):  # full: each request now holds a place of its own
            recent.add(_trace("/api/generate", model="m", queue_wait=i / 1000, prompt_tokens=i, eval_tokens=i), i / 7)
        full = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/activity.py")])
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in full.compare_to(made, "filename"))
    assert grown < 2048, f"{grown} bytes for 128 requests held"  # an object per request: ~23 KB
    last = recent.after(0)[-1]
    assert (last.queue_wait, last.load_wait, last.eval_tokens, last.duration) == (0.127, None, 127, 127 / 7)


def test_a_trace_reads_the_timings_of_each_protocol() -> None:
    trace = RequestTrace("POST", "/api/chat", "", 0.0)
    trace.counted({"prompt_eval_count": 5, "eval_count": 7, "prompt_eval_duration": 250_000_000, "eval_duration": 700_000_000})
    assert (trace.prompt_seconds, trace.eval_seconds) == (0.25, 0.7)
    trace = RequestTrace("POST", "/v1/chat/completions", "", 0.0)
    trace.counted({"usage": {"prompt_tokens": 5, "completion_tokens": 7}, "timings": {"prompt_ms": 30.0, "predicted_ms": 140}})
    assert (trace.prompt_tokens, trace.eval_tokens, trace.prompt_seconds, trace.eval_seconds) == (5, 7, 0.03, 0.14)


@pytest.mark.slow
async def test_a_real_request_reaches_the_pages_activity_history_and_models(model_store: Path) -> None:
    with trio.fail_after(90):
        async with open_test_server(model_store, api_key=KEY, context_length=256) as server, \
                httpx.AsyncClient(base_url=server.urls[0], headers=AUTH, timeout=60) as http:  # fmt: skip
            async with http.stream("GET", "/api/events") as response, aclosing(messages(response)) as stream:
                got: dict[str, Any] = {}
                async for kind, data in stream:
                    got[kind] = data
                    if kind == "models":
                        break
                (tiny,) = got["models"]["models"]
                assert tiny["name"] == "tiny:latest" and tiny["loaded"] is False and tiny["fits_now"] is True
                assert tiny["fit"] == "fits now (CPU)" and "completion" in tiny["capabilities"]
                assert tiny["num_ctx"] == 256 and tiny["estimate"] > 0 and tiny["prompt_cache"] == server.settings.cache_ram
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hello", "stream": False,
                                                           "options": {"num_predict": 8, "temperature": 0}})  # fmt: skip
                assert r.status_code == 200, r.text
                answer = r.json()
                activity: list[dict[str, Any]] = []
                tokens: dict[int, int] = {}
                memory: dict[str, int] = {}
                async for kind, data in stream:
                    if kind == "activity":
                        activity += data["requests"]
                    elif kind == "history":
                        for sample in data["samples"]:
                            tokens[sample["time"]] = sample["tokens"].get("tiny:latest", 0)
                            memory = sample["memory"].get("cpu", {})
                    if activity and sum(tokens.values()) == answer["eval_count"]:
                        break
                (done,) = activity
                assert done["model"] == "tiny:latest" and done["protocol"] == "ollama" and done["status"] == 200
                assert done["eval_tokens"] == answer["eval_count"] and done["prompt_tokens"] == answer["prompt_eval_count"]
                assert done["load_wait"] > 0 and done["slow"].endswith(" for a load") and done["ttft"] >= done["load_wait"]
                assert done["tokens_per_second"] == pytest.approx(answer["eval_count"] / (answer["eval_duration"] / 1e9))
                # the memory picture comes to agree with /api/ps (the estimate until llama.cpp reported
                # its buffers): the runner's own size, and its prompt cache apart
                ps = (await http.get("/api/ps")).json()["models"][0]
                assert ps["runner"]["size_source"] == "measured"
                want = {"tiny:latest": ps["size"], "tiny:latest" + PROMPT_CACHE: ps["runner"]["cache_ram"]}
                async for kind, data in stream:
                    if memory == want:
                        break
                    if kind == "history":
                        memory = data["samples"][-1]["memory"].get("cpu", {})
