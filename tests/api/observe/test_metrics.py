"""/metrics through prometheus_client: the scheduler's snapshot at scrape time, and counters and
histograms recorded as things happen (scheduler events under MockClock with fake runners; real
requests against a real llama-server child)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tests.scheduler.harness import running
from trioshed.api.observe.metrics import (
    CAUSES,
    FINISHED_DELAY,
    FINISHED_MAX,
    SNAPSHOT_COUNTERS,
    SNAPSHOT_GAUGES,
    Metrics,
    reason_label,
)
from trioshed.core.model import RunnerOptions
from trioshed.runner.binary import find_llama_server
from trioshed.scheduler.scheduler import SchedulerStatistics
from trioshed.testing.server import open_test_server

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition text, keyed by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float:
    got = samples.get((name, frozenset(labels.items())), default)
    assert got is not None, f"no sample {name}{labels}"
    return got


def test_every_int_field_of_the_snapshot_is_exposed() -> None:
    # A new statistics() counter (e.g. waits for memory) must be listed in SNAPSHOT_COUNTERS.
    ints = {f.name for f in dataclasses.fields(SchedulerStatistics) if f.type in ("int", int)}
    assert ints == set(SNAPSHOT_COUNTERS) | SNAPSHOT_GAUGES


def test_reasons_map_to_fixed_labels() -> None:
    assert reason_label("make room for b:latest") == "make_room"
    assert reason_label("reload: options changed") == "options_changed"
    assert reason_label("keep_alive expired") == "keep_alive_expired"
    assert reason_label("keep_alive 0") == "keep_alive_0"
    assert reason_label("unload requested") == "unload_requested"
    assert reason_label("health check failed") == "health_check"
    assert reason_label("something new") == "other"


async def test_scheduler_events_are_counted_by_reason(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1, "b": 1, "c": 1}, max_loaded=2, load_time=2) as h:
        metrics = Metrics(h.sched)
        await h.once("a", keep_alive=600)
        await h.once("b", keep_alive=60)
        await h.once("c", keep_alive=30)  # max 2 loaded: evicts b (shortest keep-alive)
        await trio.sleep(31)  # c expires
        release = trio.Event()
        await h.hold("a", release)
        h.factory.runner("a").crash(-9)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        await trio.testing.wait_all_tasks_blocked()

        s = parse(metrics.render().decode())
        for model in ("a:latest", "b:latest", "c:latest"):
            assert value(s, "trioshed_model_loads_total", model=model) == 1
            assert value(s, "trioshed_load_duration_seconds_count", model=model) == 1
            assert value(s, "trioshed_load_duration_seconds_sum", model=model) == pytest.approx(2.0)
        assert value(s, "trioshed_evictions_total", model="b:latest", reason="make_room") == 1
        assert value(s, "trioshed_model_unloads_total", model="b:latest", reason="make_room") == 1
        assert value(s, "trioshed_model_unloads_total", model="c:latest", reason="keep_alive_expired") == 1
        assert value(s, "trioshed_model_crashes_total", model="a:latest") == 1
        stats = h.sched.statistics()
        assert (stats.loads, stats.unloads, stats.crashes) == (3, 2, 1)
        assert value(s, "trioshed_loads_total") == 3
        assert value(s, "trioshed_unloads_total") == 2
        assert value(s, "trioshed_crashes_total") == 1


async def test_the_fast_renderer_writes_what_prometheus_client_writes(autojump_clock: trio.testing.MockClock) -> None:
    """render_text replaces generate_latest for speed: the same bytes, for every kind
    of sample the app's registry holds (counters, histograms, gauges, labels needing escapes)."""
    from prometheus_client import Gauge, Info
    from prometheus_client.exposition import generate_latest

    from trioshed.api.observe.metrics import render_text
    from trioshed.trace import RequestTrace

    async with running({"a": 1, "b": 1}, max_loaded=1, load_time=2) as h:
        metrics = Metrics(h.sched)
        await h.once("a", keep_alive=600)
        await h.once("b", keep_alive=60)  # evicts a
        trace = RequestTrace(method="POST", path="/api/chat", client="t", started=0.0, route="/api/chat", status=200,
                             model='we"ird\\name\nx', queue_wait=0.5)  # fmt: skip
        metrics.request_finished(trace, 0.25)
        Gauge("extra_gauge", "A gauge with a \\ and\na newline in its help.", ["k"], registry=metrics.registry).labels('v"1').set(1e21)
        Info("extra", "An info metric.", registry=metrics.registry).info({"version": "1"})
        metrics._count_events()
        metrics._count_finished()
        text = render_text(metrics.registry)
        assert b'model="we\\"ird' in text
        # the process collector's figures move between two scrapes: compare without them
        strip = lambda b: b"\n".join(line for line in b.split(b"\n") if b"process_" not in line)  # noqa: E731
        assert strip(text) == strip(generate_latest(metrics.registry))


async def test_ended_requests_are_counted_off_their_path_and_at_every_scrape(autojump_clock: trio.testing.MockClock) -> None:
    from trioshed.trace import RequestTrace

    async with running({"a": 1}) as h:
        metrics = Metrics(h.sched)
        trace = RequestTrace(method="POST", path="/api/chat", client="t", started=0.0, route="/api/chat", status=200,
                             model="a:latest", queue_wait=0.5, key="alice")  # fmt: skip
        labels = {"route": "/api/chat", "method": "POST", "status": "200"}
        count = lambda: metrics.registry.get_sample_value("trioshed_http_requests_total", labels)  # noqa: E731
        await h.nursery.start(metrics.run)
        for _ in range(10):
            metrics.request_finished(trace, 0.25)
        assert count() is None  # noted, not counted on the request's own path
        await trio.sleep(FINISHED_DELAY + 0.01)  # past its deadline, not on it (same-deadline order is not fixed)
        assert count() == 10  # counted by the metrics' task, once, a moment later
        metrics.request_finished(trace, 0.25)
        s = parse(metrics.render().decode())  # a scrape counts what waits, at once
        assert value(s, "trioshed_http_requests_total", **labels) == 11
        assert value(s, "trioshed_request_duration_seconds_count", model="a:latest", route="/api/chat") == 11
        assert value(s, "trioshed_queue_wait_seconds_sum", model="a:latest", route="/api/chat") == 0.5 * 11
        assert value(s, "trioshed_key_requests_total", key="alice", status="200") == 11
        await trio.sleep(10 * FINISHED_DELAY)
        assert count() == 11  # nothing counted twice
        for _ in range(FINISHED_MAX):  # a flood between two counts: what waits stays bounded
            metrics.request_finished(trace, 0.25)
        assert count() == 11 + FINISHED_MAX and not metrics._finished


async def test_reloads_and_keep_alive_0_are_labelled_as_such(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        metrics = Metrics(h.sched)
        await h.once("a", options=RunnerOptions(num_batch=512))
        await h.once("a", options=RunnerOptions(num_batch=256), keep_alive=0)  # reloads, then unloads at once
        await trio.sleep(1)
        s = parse(metrics.render().decode())
        assert value(s, "trioshed_evictions_total", model="a:latest", reason="options_changed") == 1
        assert value(s, "trioshed_model_unloads_total", model="a:latest", reason="options_changed") == 1
        assert value(s, "trioshed_model_unloads_total", model="a:latest", reason="keep_alive_0") == 1
        assert value(s, "trioshed_model_loads_total", model="a:latest") == 2


async def test_snapshot_gauges_read_statistics_at_scrape_time(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 2, "b": 3}, gpus=(24,), system=4) as h:
        metrics = Metrics(h.sched)
        release = trio.Event()
        await h.hold("a", release)
        await h.once("b")
        s = parse(metrics.render().decode())
        assert value(s, "trioshed_runners", state="ready") == 2
        assert value(s, "trioshed_runners", state="loading") == 0
        assert value(s, "trioshed_leases") == 1
        assert value(s, "trioshed_runner_leases", model="a:latest") == 1
        assert value(s, "trioshed_runner_leases", model="b:latest") == 0
        assert value(s, "trioshed_queued_requests") == 0
        used = sum(size for r in h.sched.statistics().runners for dev, size in r.usage if dev == "cuda:0")
        assert used == 5 * 1024**3
        assert value(s, "trioshed_device_memory_bytes", device="cuda:0", kind="used") == used
        assert value(s, "trioshed_device_memory_bytes", device="cuda:0", kind="total") == 24 * 1024**3
        assert value(s, "trioshed_device_memory_bytes", device="cpu", kind="total") == 4 * 1024**3
        assert ("trioshed_device_memory_bytes", frozenset({("device", "cuda:0"), ("kind", "free")})) not in s  # declared: no reading
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert value(parse(metrics.render().decode()), "trioshed_leases") == 0


async def test_two_servers_in_one_process_keep_their_own_registries(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as one, open_test_server(model_store) as two:
            async with httpx.AsyncClient(base_url=one.base_url) as a, httpx.AsyncClient(base_url=two.base_url) as b:
                for _ in range(3):
                    assert (await a.get("/api/version")).status_code == 200
                for i in range(3):  # made-up methods and paths add no label values
                    assert (await a.request(f"BREW{i}", f"/nothing/{i}")).status_code in (404, 405)
                s1, s2 = parse((await a.get("/metrics")).text), parse((await b.get("/metrics")).text)
        key = {"route": "/api/version", "method": "GET", "status": "200"}
        assert value(s1, "trioshed_http_requests_total", **key) == 3
        assert value(s2, "trioshed_http_requests_total", 0.0, **key) == 0
        assert value(s1, "process_resident_memory_bytes") > 0
        assert value(s1, "trioshed_http_requests_total", route="unmatched", method="other", status="404") == 3


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_counters_move_with_real_requests(model_store: Path) -> None:
    fast = {"num_predict": 4, "temperature": 0, "seed": 1}
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            before = parse((await http.get("/metrics")).text)
            assert value(before, "trioshed_loads_total") == 0
            assert all(value(before, "trioshed_unavailable_total", cause=c) == 0 for c in CAUSES.values())

            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": fast})
            assert r.status_code == 200
            async with http.stream("POST", "/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": fast}) as streamed:
                assert streamed.status_code == 200
                async for _ in streamed.aiter_lines():
                    pass
            r = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200
            assert (await http.post("/api/generate", json={"model": "nope", "prompt": "x"})).status_code == 404
            r = await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})  # unload
            assert r.status_code == 200 and r.json()["done_reason"] == "unload"

            s = parse((await http.get("/metrics")).text)
            model = "tiny:latest"
            assert value(s, "trioshed_loads_total") == 1 and value(s, "trioshed_unloads_total") == 1
            assert value(s, "trioshed_model_loads_total", model=model) == 1
            assert value(s, "trioshed_load_duration_seconds_count", model=model) == 1
            assert value(s, "trioshed_load_duration_seconds_sum", model=model) > 0
            assert value(s, "trioshed_model_unloads_total", model=model, reason="unload_requested") == 1
            for route in ("/api/generate", "/api/chat", "/v1/chat/completions"):
                assert value(s, "trioshed_request_duration_seconds_count", model=model, route=route) >= 1
                assert value(s, "trioshed_queue_wait_seconds_count", model=model, route=route) == 1
            # the first request waited for the load; its queue wait includes it
            load = value(s, "trioshed_load_duration_seconds_sum", model=model)
            assert value(s, "trioshed_queue_wait_seconds_sum", model=model, route="/api/generate") >= load
            assert value(s, "trioshed_http_requests_total", route="/api/generate", method="POST", status="200") == 2
            assert value(s, "trioshed_http_requests_total", route="/api/chat", method="POST", status="200") == 1
            assert value(s, "trioshed_http_requests_total", route="/api/generate", method="POST", status="404") == 1
            assert value(s, "trioshed_http_requests_total", route="/metrics", method="GET", status="200") == 1
            assert value(s, "trioshed_runners", state="ready") == 0  # unloaded
            assert value(s, "trioshed_device_memory_bytes", device="cpu", kind="used") == 0


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_503s_are_counted_by_cause(model_store: Path, unknown_arch_model: Path, tmp_path: Path) -> None:
    os.link(unknown_arch_model, model_store / "broken.gguf")  # a hard link: a symlink out of the store is refused
    # llama-server behind a gate: the load stays in progress until the test opens it
    real, gate, gated = find_llama_server(), tmp_path / "gate", tmp_path / "llama-server-gated"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in real.env.items() if os.environ.get(k) != v)
    wait = f'[ "$1" = --version ] || while [ ! -e {shlex.quote(str(gate))} ]; do sleep 0.02; done'  # start-up asks its version
    gated.write_text(f"#!/bin/sh\n{exports}{wait}\nexec {shlex.quote(real.path)} \"$@\"\n")
    gated.chmod(0o755)
    with trio.fail_after(120):
        async with open_test_server(model_store, max_queue=1, llama_server=str(gated)) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            # queue full: one request waits for the load, the queue holds one
            async with trio.open_nursery() as nursery:
                first = partial(http.post, "/api/generate", json={"model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 1}})
                nursery.start_soon(first)
                # starting a load wakes no statistics() waiter (wait_statistics would miss it): poll
                while server.scheduler.statistics().loading != 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "x"})
                assert r.status_code == 503 and r.headers["Retry-After"]
                r = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 503  # OpenAI's routes count theirs too
                gate.touch()
            # cooldown: a model that failed to load is refused for a while
            assert (await http.post("/api/generate", json={"model": "broken", "prompt": "x"})).status_code == 500
            r = await http.post("/api/generate", json={"model": "broken", "prompt": "x"})
            assert r.status_code == 503 and "failed to load recently" in r.json()["error"]

            s = parse((await http.get("/metrics")).text)
            assert value(s, "trioshed_unavailable_total", cause="queue_full") == 2
            assert value(s, "trioshed_unavailable_total", cause="cooldown") == 1
            assert value(s, "trioshed_unavailable_total", cause="shutting_down") == 0
            assert value(s, "trioshed_rejected_total") == 2
            assert value(s, "trioshed_load_failures_total") == 1
            assert value(s, "trioshed_model_load_failures_total", model="broken:latest") == 1
            assert value(s, "trioshed_http_requests_total", route="/api/generate", method="POST", status="503") == 2


def test_every_503_of_the_error_tree_has_a_cause_label() -> None:
    import trioshed.errors as errors

    unavailable = {
        name for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.TrioshedError) and cls.status == 503
    }  # fmt: skip
    assert unavailable == set(CAUSES)
