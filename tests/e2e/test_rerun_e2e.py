"""No request lost to a runner's death, with real llama-server children: a request whose child
was stopped, killed or hung before it had answered anything is answered by a new child, on every
protocol; a second death on the same request is an error that names both."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.scheduler.lifetime import PING_TIMEOUT
from trioshed.testing.server import Server, open_test_server
from trioshed.testing.signals import stop_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

#: Stopped child found by the checks while the request waits (the first PING_TIMEOUT after it
#: went out, two of PING_TIMEOUT failing in a row), a SIGKILL, a load of the tiny model and its
#: answer, with slack for a loaded machine.
FOUND_AND_REPLACED = 3 * PING_TIMEOUT + 8.0

#: route -> (path, body, what its stream's last event says)
STREAMS: dict[str, tuple[str, dict[str, Any], str]] = {
    "ollama generate": ("/api/generate", {"model": "tiny", "prompt": "hi", "options": {"num_predict": 4}}, '"done":true'),
    "ollama chat": ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 4}}, '"done":true'),
    "openai chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}, "data: [DONE]"),
    "openai completions": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}, "data: [DONE]"),
    "anthropic messages": ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}, "event: message_stop"),
    "openai responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}, "event: response.incomplete"),
}


def _pid(server: Server) -> int:
    [pid] = [r.pid for r in server.scheduler.statistics().runners]
    assert pid is not None
    return pid


async def _generating(server: Server, *, loads: int) -> None:
    """Wait until the ``loads``-th runner is ready, and a little more: its 3,000 tokens take seconds."""
    await server.scheduler.wait_statistics(lambda s: s.loads == loads and s.loaded == 1)
    await trio.sleep(0.3)
    assert server.scheduler.statistics().leased == 1


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_stream_sent_to_a_stopped_llama_server_is_answered_whole_by_a_new_one(
    model_store: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    # No ping before reuse: the request reaches the stopped child (the race a ping cannot close).
    monkeypatch.setattr("trioshed.scheduler.scheduler.PING_IDLE", math.inf)
    path, body, last = STREAMS[route]
    with trio.fail_after(90):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            assert (await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})).status_code == 200
            stopped = _pid(server)
            await stop_process(stopped)
            try:
                start = trio.current_time()
                async with http.stream("POST", path, json=body) as response:
                    text = (await response.aread()).decode()
                waited = trio.current_time() - start
                assert response.status_code == 200, text
                assert "exited" not in text and "stopped answering" not in text and "event: error" not in text, text
                assert last.replace(" ", "") in text.replace(" ", ""), text  # the whole answer, ended as the protocol ends it
                assert waited < FOUND_AND_REPLACED, waited
                assert _pid(server) != stopped and not _alive(stopped)
                assert server.scheduler.statistics().loads == 2
            finally:
                _kill(stopped)


#: route -> (method, path, body): answers read whole before anything is sent on
PLAIN: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "ollama generate": ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 4}}),
    "openai chat": ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "llama.cpp tokenize": ("POST", "/tokenize", {"model": "tiny", "content": "hi"}),
    "pass-through completion": ("POST", "/upstream/tiny/completion", {"prompt": "hi", "n_predict": 4}),
    "pass-through props": ("GET", "/upstream/tiny/props", None),
}


@pytest.mark.parametrize("route", sorted(PLAIN))
async def test_a_plain_request_sent_to_a_stopped_llama_server_is_answered_by_a_new_one(
    model_store: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    monkeypatch.setattr("trioshed.scheduler.scheduler.PING_IDLE", math.inf)
    method, path, body = PLAIN[route]
    with trio.fail_after(90):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            assert (await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})).status_code == 200
            stopped = _pid(server)
            await stop_process(stopped)
            try:
                start = trio.current_time()
                r = await http.request(method, path, json=body)
                waited = trio.current_time() - start
                assert r.status_code == 200, r.text
                assert waited < FOUND_AND_REPLACED, waited
                assert _pid(server) != stopped and server.scheduler.statistics().loads == 2
            finally:
                _kill(stopped)


_LONG = {"num_predict": 3000, "num_ctx": 4096, "temperature": 1}
#: route -> (path, a whole answer of 3,000 tokens, what its answer says when complete). Some are
#: read from llama-server as a stream (Anthropic's): none of it reaches the client before its end.
WHOLE_LONG: dict[str, tuple[str, dict[str, Any], str]] = {
    "ollama generate": ("/api/generate", {"model": "long", "prompt": "hello", "stream": False, "options": _LONG}, "done"),
    "anthropic messages": ("/v1/messages", {"model": "long", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3000,
                                            "temperature": 1, "num_ctx": 4096}, "stop_reason"),
}  # fmt: skip


@pytest.mark.parametrize("route", sorted(WHOLE_LONG))
async def test_a_plain_answer_whose_llama_server_is_killed_mid_generation_comes_from_a_new_one(model_store: Path, route: str) -> None:
    add_tiny(model_store, "long", context_length=4096)
    path, body, complete = WHOLE_LONG[route]
    with trio.fail_after(90):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                answers: list[httpx.Response] = []

                async def ask() -> None:
                    answers.append(await http.post(path, json=body))

                nursery.start_soon(ask)
                await _generating(server, loads=1)
                killed = _pid(server)
                os.kill(killed, signal.SIGKILL)
            [r] = answers
            assert r.status_code == 200 and r.json()[complete], r.text
            stats = server.scheduler.statistics()
            assert stats.loads == 2 and stats.crashes == 1 and _pid(server) != killed


@pytest.mark.parametrize("route", sorted(WHOLE_LONG))
async def test_a_plain_answer_whose_llama_server_hangs_mid_generation_comes_from_a_new_one(model_store: Path, route: str) -> None:
    add_tiny(model_store, "long", context_length=4096)
    path, body, complete = WHOLE_LONG[route]
    with trio.fail_after(90):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                answers: list[httpx.Response] = []

                async def ask() -> None:
                    answers.append(await http.post(path, json=body))

                nursery.start_soon(ask)
                await _generating(server, loads=1)
                hung = _pid(server)
                await stop_process(hung)
                try:
                    with trio.fail_after(FOUND_AND_REPLACED):
                        await server.scheduler.wait_statistics(lambda s: s.loads == 2)
                finally:
                    _kill(hung)
            [r] = answers
            assert r.status_code == 200 and r.json()[complete], r.text
            assert ("unhealthy", "long:latest") in [(e.kind, e.model) for e in server.scheduler.events.after()]


async def test_a_request_whose_second_llama_server_dies_too_gets_an_error_naming_both(model_store: Path) -> None:
    add_tiny(model_store, "long", context_length=4096)
    body = {"model": "long", "prompt": "hello", "stream": False, "options": {"num_predict": 3000, "num_ctx": 4096, "temperature": 1}}
    with trio.fail_after(90):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                answers: list[httpx.Response] = []

                async def ask() -> None:
                    answers.append(await http.post("/api/generate", json=body))

                nursery.start_soon(ask)
                for loads in (1, 2):
                    await _generating(server, loads=loads)
                    os.kill(_pid(server), signal.SIGKILL)
            [r] = answers
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert "died twice on this request" in error and error.count("code -9") == 2, error
            assert "/" not in error.split("died twice")[1].replace("/api", ""), error  # no path leaks
            r = await http.post("/api/generate", json={**body, "options": {**body["options"], "num_predict": 2}})
            assert r.status_code == 200  # a third runner serves the next request


async def test_requests_waiting_for_a_llama_server_killed_while_loading_are_answered_by_the_next_load(gemma_store: Path) -> None:
    # gemma3 takes seconds to load: time to SIGKILL the child mid-load, as the OOM killer would.
    body = {"model": "gemma3-270m", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    with trio.fail_after(120):
        async with open_test_server(gemma_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=100) as http:
            async with trio.open_nursery() as nursery:
                answers: list[httpx.Response] = []

                async def ask() -> None:
                    answers.append(await http.post("/api/generate", json=body))

                for _ in range(2):
                    nursery.start_soon(ask)
                await server.scheduler.wait_statistics(lambda s: s.loading == 1 and s.queued == 2)
                child = None
                while child is None:  # spawned from this process: find it among our children
                    child = next((p for p in psutil.Process().children(recursive=True) if "llama-server" in p.name()), None)
                    await trio.sleep(0.01)
                child.kill()
            assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
            stats = server.scheduler.statistics()
            assert (stats.loads, stats.load_failures, stats.loaded) == (2, 1, 1)
