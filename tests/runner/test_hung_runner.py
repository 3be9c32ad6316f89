"""A hung runner (alive, answering nothing) is found where it matters: before an idle one is
reused, and by the health monitor while it streams; it is killed and its model reloaded."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest
import trio
import trio.testing

from tests.conftest import add_tiny
from tests.e2e.test_faults import LONG_CTX
from tests.scheduler.harness import running, spec
from trioshed.core.model import RunnerOptions
from trioshed.scheduler.lifetime import HEALTH_INTERVAL, HEALTH_TIMEOUT, PING_IDLE, PING_TIMEOUT
from trioshed.testing.server import open_test_server
from trioshed.testing.signals import stop_process


async def test_an_idle_runner_that_stopped_answering_is_replaced_before_reuse(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}, load_time=1.0) as h:
        await h.once("a", keep_alive=math.inf)
        first = h.factory.runner("a")
        await trio.sleep(PING_IDLE + 1)
        first.frozen = True  # SIGSTOP: /health never answers
        start = trio.current_time()
        lease = await h.once("a")
        assert trio.current_time() - start <= PING_TIMEOUT + 1.0 + 0.01  # the ping, then one load
        assert lease.handle is not first and first.exited and first.returncode == -9
        assert h.factory.started == 2 and ("unhealthy", "a") in h.record
        assert h.sched.statistics().leased == 0


async def test_a_runner_in_use_is_not_pinged(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release, two = trio.Event(), RunnerOptions(num_parallel=2)
        await h.hold("a", release, keep_alive=math.inf, options=two)
        await trio.sleep(PING_IDLE + 1)
        h.factory.runner("a").frozen = True
        got: list[str] = []
        async with h.sched.acquire(spec("a"), two):  # its second slot, no ping: at once
            got.append("a")
        assert got == ["a"] and h.factory.started == 1
        release.set()


async def test_streams_on_a_runner_declared_hung_end_with_its_error(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}) as h:
        release = trio.Event()
        lease = await h.hold("a", release, keep_alive=math.inf)
        runner = h.factory.runner("a")
        runner.frozen = True
        start = trio.current_time()
        await runner.wait_exited()  # the monitor kills it although a stream holds it
        assert trio.current_time() - start <= 2 * (HEALTH_INTERVAL + HEALTH_TIMEOUT) + 0.01
        await trio.testing.wait_all_tasks_blocked()
        assert lease.crash is not None and "stopped answering" in lease.crash.message
        release.set()
        await h.once("a")
        assert h.factory.started == 2


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_a_request_to_a_stopped_idle_llama_server_is_answered_by_a_new_one(
    model_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trioshed.scheduler.scheduler.PING_IDLE", 0.0)  # every reuse pings
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            assert (await http.post("/api/generate", json=body)).status_code == 200
            [hung] = [r.pid for r in server.scheduler.statistics().runners]
            assert hung is not None
            await stop_process(hung)
            try:
                stopped_at = trio.current_time()
                r = await http.post("/api/generate", json=body)
                waited = trio.current_time() - stopped_at
                assert r.status_code == 200 and r.json()["done"] is True, (waited, r.text)
                # the ping (or, when the child stops only after answering it, the checks while the
                # request waits: PING_TIMEOUT, then two failing in a row), a SIGKILL and a load of
                # the tiny model
                assert waited < 3 * PING_TIMEOUT + 8.0
                assert [r.pid for r in server.scheduler.statistics().runners] != [hung]
                assert server.scheduler.statistics().loads == 2
            finally:
                if _alive(hung):
                    os.kill(hung, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_a_stream_on_a_llama_server_declared_hung_ends_with_an_error_line(
    model_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trioshed.scheduler.lifetime.HEALTH_INTERVAL", 0.5)
    monkeypatch.setattr("trioshed.scheduler.lifetime.HEALTH_TIMEOUT", 1.0)
    add_tiny(model_store, "long", context_length=LONG_CTX)
    body = {"model": "long", "prompt": "hello", "options": {"num_predict": LONG_CTX, "num_ctx": LONG_CTX, "temperature": 1}}
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with http.stream("POST", "/api/generate", json=body) as response:
                lines = response.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                [hung] = [r.pid for r in server.scheduler.statistics().runners]
                assert hung is not None
                await stop_process(hung)
                stopped_at = trio.current_time()
                rest = [json.loads(line) async for line in lines if line]
                waited = trio.current_time() - stopped_at
            assert "stopped answering" in rest[-1]["error"], rest[-2:]
            assert waited < 2 * (0.5 + 1.0) + 5.0  # two failed checks, plus slack for a loaded machine
            assert not _alive(hung)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
