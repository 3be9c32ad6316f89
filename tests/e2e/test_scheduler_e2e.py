"""The scheduler end to end: real llama-server children, a declared device inventory.

Memory pressure uses TRIOSHED_DEVICES-style inventories sized from the models' own estimates:
the scheduler accounts memory as if the children sat on those devices (they run on the CPU).
Slots are held by a slow real stream (gemma3-270m, ~20 tokens/s on one thread).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.core.model import Device
from trioshed.core.placement import place
from trioshed.models.store import ModelStore
from trioshed.server import estimate_model
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0}


async def generate(http: httpx.AsyncClient, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "stream": False, "options": FAST, **extra}
    return await http.post("/api/generate", json=body)


async def test_eviction_under_memory_pressure_across_three_models(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    for name, seed in (("one", 1), ("two", 2), ("three", 3)):
        add_tiny(store, name, seed=seed)
    # Once loaded, a runner counts with what llama.cpp reported (measured, shared out over the
    # devices as planned), not the estimate: learn its share of a GPU first, then declare a GPU
    # where two fit and the third does not. A request is planned with the estimate of the
    # options the server gives it (flash attention among them): those "one" loaded with, the
    # same for all three. No prompt cache (TRIOSHED_CACHE_RAM): the sizes are the buffers alone.
    big = Device("cuda:0", "cuda", 0, 1 << 40, 1 << 40)
    async with open_test_server(store, devices=(big,), cache_ram=0) as probe, httpx.AsyncClient(
        base_url=probe.base_url, timeout=60
    ) as http:
        assert (await generate(http, "one")).status_code == 200
        (loaded,) = probe.scheduler.statistics().runners
    assert loaded.options.num_ctx == 2048  # trained: 2048
    planned = max(
        place(estimate_model(ModelStore(store).resolve(n), loaded.options), [big], system_free=1 << 40).vram_total  # type: ignore[union-attr]
        for n in ("one", "two", "three")
    )
    measured = loaded.size_vram
    assert 0 < measured <= planned
    total = planned + measured + measured // 2
    gpu = Device("cuda:0", "cuda", 0, total, total)
    record: list[tuple[str, str]] = []
    with trio.fail_after(120):
        async with open_test_server(store, devices=(gpu,), record=record, cache_ram=0) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            for name in ("one", "two"):
                assert (await generate(http, name)).status_code == 200
            assert {r.model for r in server.scheduler.statistics().runners} == {"one:latest", "two:latest"}
            record.clear()
            assert (await generate(http, "three")).status_code == 200
            runners = {r.model: r for r in server.scheduler.statistics().runners}
            assert set(runners) == {"two:latest", "three:latest"}  # "one" was idle longest
            assert [e for e in record if e[0] in ("evict", "unloaded", "load")] == [
                ("evict", "one"), ("unloaded", "one"), ("load", "three"),
            ]  # fmt: skip
            ps = (await http.get("/api/ps")).json()["models"]
            # accounted on the declared GPU as planned: token embeddings and the host compute
            # buffer (inputs, masks, logits) stay in system memory, as in llama.cpp
            share = {r.model: r.placement.vram_total / r.placement.total for r in runners.values() if r.placement}
            assert all(m["size_vram"] == pytest.approx(share[m["name"]] * m["size"], rel=0.01) for m in ps), ps
            assert all(m["runner"]["n_gpu_layers"] == 3 and 0 < m["size_vram"] < m["size"] for m in ps), ps  # 2 layers + output


async def test_kill_9_mid_stream_ends_the_stream_with_an_error_and_reloads(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            body = {"model": "tiny", "prompt": "hello", "options": {"num_predict": 3000, "temperature": 1}}
            async with http.stream("POST", "/api/generate", json=body) as response:
                lines = response.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                pid = server.scheduler.statistics().runners[0].pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                rest = [json.loads(line) async for line in lines if line]
            assert "error" in rest[-1], rest[-3:]
            assert "exited unexpectedly" in rest[-1]["error"] and not any(c.get("done") for c in rest)
            stats = await server.scheduler.wait_statistics(lambda s: s.leased == 0)
            assert stats.crashes == 1 and stats.runners == ()
            assert (await generate(http, "tiny")).status_code == 200
            assert server.scheduler.statistics().loads == 2


async def _hold_slot(http: httpx.AsyncClient, started: trio.Event, stop: trio.Event) -> None:
    """Stream a long gemma answer, holding its only slot until ``stop``, then hang up."""
    body = {"model": "gemma3-270m", "prompt": "Write a long story about a lighthouse.",
            "options": {"num_predict": 2000, "temperature": 0.8}}  # fmt: skip
    async with http.stream("POST", "/api/generate", json=body) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        await lines.__anext__()
        started.set()
        await stop.wait()


async def test_queue_full_503_and_a_client_leaving_the_queue(gemma_store: Path) -> None:
    with trio.fail_after(240):
        async with open_test_server(gemma_store, max_queue=1) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=120
        ) as http, trio.open_nursery() as nursery:
            started, stop = trio.Event(), trio.Event()
            nursery.start_soon(_hold_slot, http, started, stop)
            await started.wait()

            # A queued client that gives up leaves the queue at once.
            async def impatient() -> None:
                with trio.move_on_after(1):
                    await generate(http, "gemma3-270m")

            nursery.start_soon(impatient)
            await server.scheduler.wait_statistics(lambda s: s.queued == 1)
            stats = await server.scheduler.wait_statistics(lambda s: s.queued == 0)
            assert stats.leased == 1

            # One waits in the queue; the next is refused with 503 and Retry-After.
            results: list[httpx.Response] = []
            answered = trio.Event()

            async def patient() -> None:
                results.append(await generate(http, "gemma3-270m"))
                answered.set()

            nursery.start_soon(patient)
            await server.scheduler.wait_statistics(lambda s: s.queued == 1)
            refused = await generate(http, "gemma3-270m")
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert refused.json() == {"error": "server busy, please try again. maximum pending requests exceeded"}

            stop.set()  # the holder hangs up: its lease goes, the queued request runs
            with trio.fail_after(120):
                await answered.wait()
            assert results[0].status_code == 200 and results[0].json()["done"] is True
            assert server.scheduler.statistics().loads == 1


@pytest.fixture
def broken_store(model_store: Path, unknown_arch_model: Path) -> Path:
    """The tiny store plus "broken": a model only llama-server refuses."""
    os.link(unknown_arch_model, model_store / "broken.gguf")
    return model_store


async def test_load_failure_is_500_then_503_cooldown(broken_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(broken_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            first = await generate(http, "broken")
            # llama-server's own words, when its asynchronous logger kept them (see test_runner)
            assert first.status_code == 500 and "before it was ready" in first.json()["error"], first.text
            again = await generate(http, "broken")
            assert again.status_code == 503 and int(again.headers["Retry-After"]) >= 9
            assert "failed to load recently" in again.json()["error"]
            assert (await generate(http, "tiny")).status_code == 200  # others are unaffected
            stats = server.scheduler.statistics()
            assert stats.load_failures == 1 and [r.model for r in stats.runners] == ["tiny:latest"]


async def test_ps_lists_runners_by_expiry(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    for name, seed in (("later", 1), ("sooner", 2), ("never", 3)):
        add_tiny(store, name, seed=seed)
    with trio.fail_after(60):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for name, keep_alive in (("later", "1h"), ("never", -1), ("sooner", "10m")):
                assert (await generate(http, name, keep_alive=keep_alive)).status_code == 200
            ps = (await http.get("/api/ps")).json()["models"]
            assert [m["name"] for m in ps] == ["sooner:latest", "later:latest", "never:latest"]
            assert all(m["context_length"] == 2048 and len(m["digest"]) == 64 for m in ps)
