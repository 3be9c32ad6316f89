"""Faults, one test each, with real processes: a hung runner, a runner that never gets ready,
model files and the store changing under a loaded runner, and a killed trioshed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.serve_process import serve_process
from trioshed.testing.server import open_test_server
from trioshed.testing.signals import stop_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}
LONG_CTX = 131072  # streams for tens of seconds (see test_lifecycle)


async def generate(http: httpx.AsyncClient, model: str) -> httpx.Response:
    return await http.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False, "options": FAST})


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _exits_within(pid: int, seconds: float) -> bool:
    try:
        psutil.Process(pid).wait(seconds)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


async def test_a_hung_runner_ends_its_stream_within_the_idle_timeout_and_is_replaced(model_store: Path) -> None:
    add_tiny(model_store, "long", context_length=LONG_CTX)
    body = {"model": "long", "prompt": "hello", "options": {"num_predict": LONG_CTX, "num_ctx": LONG_CTX, "temperature": 1}}
    with trio.fail_after(120):
        async with open_test_server(model_store, stream_idle_timeout=2.0) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            assert (await generate(http, "tiny")).status_code == 200
            async with http.stream("POST", "/api/generate", json=body) as response:
                lines = response.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                hung = next(r.pid for r in server.scheduler.statistics().runners if r.model == "long:latest")
                assert hung is not None
                await stop_process(hung)
                stopped_at = trio.current_time()
                # another model keeps serving while this one hangs
                assert (await generate(http, "tiny")).status_code == 200
                rest = [json.loads(line) async for line in lines if line]
                waited = trio.current_time() - stopped_at
            assert "sent nothing for 2s" in rest[-1]["error"], rest[-2:]
            assert waited < 2.0 + 10.0  # the idle bound, plus generous slack for a loaded machine
            with trio.fail_after(20):  # SIGTERM + SIGCONT: the stopped child exits at once
                await server.scheduler.wait_statistics(lambda s: all(r.model != "long:latest" for r in s.runners))
            assert gone(hung)
            r = await http.post("/api/generate", json={**body, "stream": False, "options": {**body["options"], "num_predict": 4}})
            assert r.status_code == 200 and r.json()["done"] is True
            assert server.scheduler.statistics().loads == 3  # tiny, long, long again


NEVER_READY = """\
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen(16)
held = []
while True:  # accept connections, never answer one
    conn, _ = sock.accept()
    held.append(conn)
"""


async def test_a_runner_that_never_answers_health_fails_after_the_load_timeout_and_is_reaped(
    model_store: Path, tmp_path: Path
) -> None:
    script = tmp_path / "fake-llama-server"
    script.write_text(f"#!{sys.executable}\n{NEVER_READY}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    with trio.fail_after(60):
        async with open_test_server(model_store, llama_server=str(script), load_timeout=2.0) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            started = trio.current_time()
            r = await generate(http, "tiny")
            assert r.status_code == 500 and "no progress" in r.json()["error"] and "TRIOSHED_LOAD_TIMEOUT" in r.json()["error"]
            assert 2.0 <= trio.current_time() - started < 2.0 + 10.0
            stats = server.scheduler.statistics()
            assert stats.runners == () and stats.load_failures == 1
            fakes = [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]
            assert not [p for p in fakes if not gone(p.pid)]
            r = await generate(http, "tiny")  # in its back-off: 503 with Retry-After, no new child
            assert r.status_code == 503 and "Retry-After" in r.headers


async def test_model_files_and_the_store_changing_under_a_loaded_runner(model_store: Path) -> None:
    add_tiny(model_store, "other")
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            assert (await generate(http, "tiny")).status_code == 200
            assert (await generate(http, "other")).status_code == 200
            # deleted while loaded: the name is gone from the store, the process goes on
            (model_store / "tiny.gguf").unlink()
            r = await generate(http, "tiny")
            assert r.status_code == 404 and r.json() == {"error": "model 'tiny' not found"}
            assert "tiny:latest" not in [m["name"] for m in (await http.get("/api/tags")).json()["models"]]
            assert (await http.get("/api/ps")).status_code == 200
            # truncated while loaded: a clear error, never a traceback; trioshed goes on
            other = model_store / "other.gguf"
            os.truncate(other, 100)
            r = await generate(http, "other")
            assert r.status_code == 500 and "cannot read model 'other:latest': damaged GGUF file" in r.json()["error"], r.text
            r = await http.post("/api/show", json={"model": "other"})  # it said "internal error" with the path
            assert r.status_code == 500 and "damaged GGUF file" in r.json()["error"], r.text
            assert str(model_store) not in r.text and "Error" not in r.text
            assert len(server.scheduler.statistics().runners) == 2  # nothing crashed meanwhile
            # replaced by another model file (written aside, renamed over it): served again
            add_tiny(model_store, "fresh")
            os.replace(model_store / "fresh.gguf", other)
            r = await generate(http, "other")
            assert r.status_code == 200, r.text
            assert (await http.post("/api/show", json={"model": "other"})).status_code == 200
            # the store folder disappears altogether
            shutil.rmtree(model_store)
            assert (await http.get("/api/tags")).json() == {"models": []}
            r = await generate(http, "tiny")
            assert r.status_code == 404
            assert (await http.get("/v1/models")).json()["data"] == []
            assert (await http.get("/api/ps")).status_code == 200
            assert (await http.get("/")).status_code == 200


async def test_sigkill_of_trioshed_leaves_no_runner_behind(model_store: Path) -> None:
    with trio.fail_after(60):
        async with serve_process(model_store) as served, httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            assert (await generate(http, "tiny")).status_code == 200
            pids = served.runner_pids()
            assert len(pids) == 1
            served.process.send_signal(signal.SIGKILL)
            await served.wait_exit()
            # the parent-death signal: SIGTERM to every runner
            alive = await trio.to_thread.run_sync(lambda: [p for p in pids if not _exits_within(p, 15)])
            assert not alive
