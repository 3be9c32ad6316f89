"""A web page the user visits must not drive their trioshed, nor its runners; a killed trioshed
leaves no runner behind (found against a real ``trioshed serve``)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from tests.support.serve_process import serve_process
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 2, "temperature": 0, "seed": 1}
EVIL = ("http://localhost.evil.example", "http://127.0.0.1.evil.example", "https://localhost-evil.example", "http://evil.example")


def _runner(model: str) -> psutil.Process:
    """This process's llama-server child serving ``model`` (its argv names it with --alias)."""
    for child in psutil.Process().children(recursive=True):
        argv = child.cmdline()
        if "--alias" in argv and argv[argv.index("--alias") + 1] == model:
            return child
    raise AssertionError(f"no runner for {model}")


async def test_a_foreign_origin_is_refused_before_anything_happens(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store, origins=("https://app.example",)) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=30
        ) as http:
            for origin in EVIL:
                # a preflight, and the "simple" requests a page sends without one
                r = await http.options("/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
                assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers, origin
                for method, path, body in (
                    ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": FAST}),
                    ("POST", "/api/generate", {"model": "tiny", "keep_alive": 0}),
                    ("POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
                    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
                    ("GET", "/api/tags", None), ("POST", "/api/show", {"model": "tiny"}), ("DELETE", "/api/delete", {"model": "tiny"}),
                    ("GET", "/nowhere", None),
                ):  # fmt: skip
                    r = await http.request(method, path, json=body, headers={"Origin": origin, "Content-Type": "text/plain"})
                    assert r.status_code == 403, (origin, path, r.status_code)
                    assert "Access-Control-Allow-Origin" not in r.headers and "TRIOSHED_ORIGINS" in r.text
            assert (await http.get("/api/ps")).json() == {"models": []}  # nothing was loaded
            assert (model_store / "tiny.gguf").exists()
            # allowed origins (defaults, configured, same-origin) act and can read the answer
            for origin in ("http://localhost:3000", "https://app.example", server.base_url, "vscode-webview://x"):
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": FAST},
                                    headers={"Origin": origin})  # fmt: skip
                assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == origin, origin
            r = await http.options("/api/chat", headers={"Origin": "http://127.0.0.1:5173", "Access-Control-Request-Method": "POST"})
            assert r.status_code == 204 and "x-api-key" in r.headers["Access-Control-Allow-Headers"]
            assert (await http.get("/api/version")).status_code == 200  # no Origin: not a browser's cross-origin request


async def test_a_rebound_host_name_is_refused_on_loopback(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            port = server.base_url.rsplit(":", 1)[1]
            for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}"):
                for method, path, body in (("GET", "/api/tags", None), ("POST", "/api/show", {"model": "tiny"}),
                                           ("POST", "/api/generate", {"model": "tiny", "keep_alive": "5m"})):  # fmt: skip
                    r = await http.request(method, path, json=body, headers={"Host": host})
                    assert r.status_code == 403 and "tiny" not in r.text, (host, path)
            assert (await http.get("/api/ps")).json() == {"models": []}
            for host in (f"localhost:{port}", f"app.localhost:{port}", f"127.0.0.1:{port}", f"{socket.gethostname()}:{port}"):
                assert (await http.get("/api/tags", headers={"Host": host})).status_code == 200, host


async def test_off_loopback_the_key_guards_and_host_names_are_not_checked(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store, host="0.0.0.0", api_key="k3y") as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=30
        ) as http:
            r = await http.get("/api/tags", headers={"Host": "box.example", "Authorization": "Bearer k3y"})
            assert r.status_code == 200
            assert (await http.get("/api/tags", headers={"Host": "box.example"})).status_code == 401


async def test_the_api_key_is_also_accepted_as_x_api_key(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store, api_key="k3y") as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            assert (await http.get("/api/tags", headers={"x-api-key": "k3y"})).status_code == 200
            assert (await http.get("/api/tags", headers={"Authorization": "Bearer k3y"})).status_code == 200
            r = await http.get("/api/tags", headers={"x-api-key": "k3y-wrong"})
            assert r.status_code == 401 and "x-api-key" in r.json()["error"] and "k3y" not in r.text.replace("x-api-key", "")


async def test_a_runner_answers_only_trioshed(model_store: Path) -> None:
    """From outside: a page that found a runner's port gets neither CORS nor answers."""
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": FAST})
            assert r.status_code == 200
            runner = _runner("tiny:latest")
            argv = runner.cmdline()
            port = argv[argv.index("--port") + 1]
            secret = runner.environ()["LLAMA_API_KEY"]
            assert len(secret) >= 32 and not any(secret in part for part in argv)  # not on the command line
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as direct:
                r = await direct.options("/completion", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
                assert r.headers.get("Access-Control-Allow-Origin") in (None, "http://trioshed.invalid")
                assert r.headers.get("Access-Control-Allow-Credentials") != "true"
                for path in ("/completion", "/v1/chat/completions", "/props", "/slots"):
                    r = await direct.post(path, content=b'{"prompt": "hi", "n_predict": 2}',
                                          headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})  # fmt: skip
                    assert r.status_code == 401, (path, r.status_code)
                    assert r.headers.get("Access-Control-Allow-Origin") in (None, "http://trioshed.invalid")
                assert (await direct.get("/health")).status_code == 200  # readiness stays open
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": True, "options": FAST})
            assert r.status_code == 200 and '"done": true' in r.text.strip().splitlines()[-1]


@pytest.mark.slow
async def test_sigkill_of_trioshed_while_a_runner_is_stopped_leaves_no_orphan(model_store: Path) -> None:
    """A stopped process does not act on SIGTERM (the old parent-death signal) until continued."""
    pid = None
    try:
        with trio.fail_after(60):
            async with serve_process(model_store) as served, httpx.AsyncClient(base_url=served.url, timeout=30) as http:
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": FAST})
                assert r.status_code == 200
                [pid] = served.runner_pids()
                os.kill(pid, signal.SIGSTOP)
                served.process.send_signal(signal.SIGKILL)
                await served.wait_exit()
                runner = psutil.Process(pid)
                try:
                    await trio.to_thread.run_sync(runner.wait, 10)
                except psutil.TimeoutExpired:
                    raise AssertionError(f"runner {pid} outlived its SIGKILLed trioshed ({runner.status()})") from None
                except psutil.NoSuchProcess:
                    pass
    finally:
        if pid is not None:
            try:  # never leave it behind, even when the assertion failed
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
