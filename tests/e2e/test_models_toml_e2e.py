"""models.toml end to end: preload, pinned, aliases, num_parallel and args with real llama-server
children (real clock, ``fail_after`` guards)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from trioshed.core.model import RunnerOptions
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

TOML = """
[models.pre]
path = "tiny.gguf"
aliases = ["pre-alias"]
num_parallel = 2
num_ctx = 256
pinned = true
preload = true
args = ["--no-warmup", "--cache-ram", "0", "--rope-freq-scale", "1.0"]

[models.broken]
path = "broken.gguf"
preload = true

[models.typo]
path = "tiny.gguf"
pinned = "yes"
"""


async def test_preloaded_pinned_parallel_model_with_aliases_and_args(
    model_store: Path, unknown_arch_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.link(unknown_arch_model, model_store / "broken.gguf")
    os.link(model_store / "tiny.gguf", model_store / "other.gguf")  # another file: another runner
    (model_store / "models.toml").write_text(TOML)
    caplog.set_level(logging.INFO)
    record: list[tuple[str, str]] = []
    with trio.fail_after(60):
        async with open_test_server(model_store, record=record) as server, httpx.AsyncClient(base_url=server.base_url) as client:
            # Loaded before the first request; the broken preload was logged and did not stop start-up.
            stats = server.scheduler.statistics()
            assert [(r.model, r.state, r.slots, r.context_length) for r in stats.runners] == [("pre:latest", "ready", 2, 256)]
            messages = [r.getMessage() for r in caplog.records]
            assert any("models.typo.pinned: must be true or false" in m and "models.toml" in m for m in messages)
            assert any(m.startswith("preload of broken:latest failed") for m in messages)

            ps = (await client.get("/api/ps")).json()["models"]
            assert [m["name"] for m in ps] == ["pre:latest"] and ps[0]["expires_at"].startswith("2318")  # pinned: forever
            tags = {m["name"] for m in (await client.get("/api/tags")).json()["models"]}
            assert {"pre:latest", "pre-alias:latest", "tiny:latest", "other:latest", "broken:latest"} <= tags and "typo:latest" not in tags

            # The allow-listed args reached llama-server (which accepted them: it is serving).
            pid = stats.runners[0].pid
            assert pid is not None
            argv = psutil.Process(pid).cmdline()
            assert argv[argv.index("--parallel") + 1] == "2"
            at = argv.index("--no-warmup")
            assert argv[at : at + 3] == ["--no-warmup", "--rope-freq-scale", "1.0"]
            # models.toml's --cache-ram becomes the runner's own (counted in its estimate)
            assert argv.count("--cache-ram") == 1 and argv[argv.index("--cache-ram") + 1] == "0"

            # The alias is the same model: served by the preloaded runner, no new load.
            record.clear()
            reply = await client.post(
                "/api/generate", json={"model": "pre-alias", "prompt": "hi", "options": {"num_predict": 4, "temperature": 0}, "stream": False}
            )
            assert reply.status_code == 200 and reply.json()["model"] == "pre-alias:latest"
            assert [e for e in record if e[0] == "load"] == []

            # num_parallel = 2: two leases at once on the one runner.
            spec = server.state.store.resolve("pre")
            options = server.state.runner_options(spec, {})
            # num_batch: never above the context (256); flash attention automatic: on for the CPU
            assert options == RunnerOptions(
                num_ctx=256, num_batch=256, num_parallel=2, num_thread=1, cache_ram_mib=0, extra_args=("--no-warmup", "--rope-freq-scale", "1.0"),
                speculation="ngram", flash_attention=True,
            )
            assert argv[argv.index("--flash-attn") + 1] == "on"
            async with server.scheduler.acquire(spec, options) as first:
                with trio.fail_after(5):
                    async with server.scheduler.acquire(spec, options) as second:
                        assert first.handle is second.handle
                        assert server.scheduler.statistics().leased == 2

            # A model without num_parallel keeps TRIOSHED_NUM_PARALLEL (1 here).
            reply = await client.post("/api/generate", json={"model": "other", "prompt": "hi", "options": {"num_predict": 2}, "stream": False})
            assert reply.status_code == 200
            slots = {r.model: r.slots for r in server.scheduler.statistics().runners}
            assert slots == {"pre:latest": 2, "other:latest": 1}
