"""Graceful drain of a real ``python -m trioshed serve`` process (SIGTERM/SIGINT)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.serve_process import ServeProcess, serve_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

# A tiny model writes ~5,000 tokens/s here, and llama-server stops at its training context: one
# with a 128 Ki context streams for tens of seconds.
LONG_CTX = 131072
LONG = {"model": "long", "prompt": "hello", "options": {"num_predict": LONG_CTX, "num_ctx": LONG_CTX, "temperature": 1, "seed": 1}}


@pytest.fixture
def long_store(model_store: Path) -> Path:
    add_tiny(model_store, "long", context_length=LONG_CTX)
    return model_store


def assert_no_runner(pids: list[int]) -> None:
    assert pids, "the test should have loaded a runner"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


async def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(long_store: Path) -> None:
    with trio.fail_after(90):
        async with serve_process(long_store, TRIOSHED_SHUTDOWN_TIMEOUT="60") as served, httpx.AsyncClient(
            base_url=served.url, timeout=60
        ) as http:
            # Long enough (seconds of generation) to be in flight when the signal is handled: 200
            # tokens of a tiny model took ~20 ms, and under load the whole answer could already be
            # sent (sitting in the socket) by the time the client read its first line.
            body = {"model": "long", "prompt": "hello", "options": {"num_predict": 3000, "num_ctx": LONG_CTX, "temperature": 0, "seed": 1}}
            async with http.stream("POST", "/api/generate", json=body) as response:
                lines = response.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                pids = served.runner_pids()
                served.process.send_signal(signal.SIGTERM)
                rest = [json.loads(line) async for line in lines if line]
            assert rest[-1]["done"] is True and not any("error" in c for c in rest), rest[-2:]
            with trio.fail_after(30):
                assert await served.wait_exit() == 0, served.log()[-2000:]
            assert_no_runner(pids)
            assert "draining 1 request(s)" in served.log()


async def _refused_while_draining(served: ServeProcess) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as other:
        r = await other.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.json() == {"error": "trioshed is shutting down"}
        r = await other.get("/api/tags")
        assert r.status_code == 503
        r = await other.get("/v1/models")  # OpenAI's error shape on /v1/
        assert r.status_code == 503 and r.json()["error"]["message"] == "trioshed is shutting down"


@pytest.mark.parametrize("ending", ["timeout", "second signal"])
async def test_drain_refuses_new_requests_then_cuts_the_stream_with_an_error_line(long_store: Path, ending: str) -> None:
    timeout = "2" if ending == "timeout" else "600"
    with trio.fail_after(90):
        async with serve_process(long_store, TRIOSHED_SHUTDOWN_TIMEOUT=timeout) as served, httpx.AsyncClient(
            base_url=served.url, timeout=60
        ) as http:
            async with http.stream("POST", "/api/generate", json=LONG) as response:
                lines = response.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                pids = served.runner_pids()
                served.process.send_signal(signal.SIGTERM)
                await trio.sleep(0.3)
                await _refused_while_draining(served)
                assert served.process.poll() is None  # still draining: the stream goes on
                if ending == "second signal":
                    served.process.send_signal(signal.SIGINT)
                rest = [json.loads(line) async for line in lines if line]
            assert rest[-1] == {"error": "trioshed is shutting down"}, rest[-2:]
            assert not any(c.get("done") for c in rest)
            with trio.fail_after(30):
                assert await served.wait_exit() == 0, served.log()[-2000:]
            assert_no_runner(pids)
