"""Access control: the API key on every route but GET/HEAD /, official clients passing it, the
key kept out of logs and errors, runners on loopback only, and model paths kept in the store."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import ollama
import openai
import psutil
import pytest
import trio

from tests.support.serve_process import serve_process
from trioshed.errors import Forbidden
from trioshed.models.store import ModelStore
from trioshed.server import is_loopback
from trioshed.testing.server import open_test_server

KEY = "k3y-that-must-not-leak-0123456789"
ROUTES = [
    ("GET", "/api/tags"), ("GET", "/api/ps"), ("GET", "/api/version"), ("GET", "/v1/models"), ("GET", "/metrics"),
    ("POST", "/api/generate"), ("POST", "/api/chat"), ("POST", "/api/show"), ("POST", "/api/embed"),
    ("POST", "/api/embeddings"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"), ("DELETE", "/api/delete"), ("POST", "/api/pull"), ("GET", "/nowhere"),
    ("POST", "/"), ("DELETE", "/"), ("GET", "/api/events"), ("POST", "/api/pin"), ("POST", "/ui"),
]  # fmt: skip


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_every_route_but_the_root_needs_the_key_and_the_key_never_shows(model_store: Path) -> None:
    with trio.fail_after(120):
        async with serve_process(model_store, TRIOSHED_API_KEY=KEY) as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            assert (await http.get("/")).status_code == 200
            assert (await http.head("/")).status_code == 200
            for method, path in ROUTES:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
                    r = await http.request(method, path, headers=headers, json={"model": "tiny"})
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert KEY not in r.text and "API key" in r.text
            # the official clients pass it
            client = ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"})
            reply = await in_thread(client.generate, model="tiny", prompt="hi", options={"num_predict": 4})
            assert reply.done
            oa = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY)
            chat = await in_thread(oa.chat.completions.create, model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert chat.choices[0].message.role == "assistant"
            with pytest.raises(openai.AuthenticationError):
                await in_thread(openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong").models.list)
            # runners listen on loopback only: the argv says so and the socket agrees
            (pid,) = served.runner_pids()
            runner = psutil.Process(pid)
            argv = runner.cmdline()
            assert argv[argv.index("--host") + 1] == "127.0.0.1"
            listening = [c.laddr for c in runner.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
            r = await http.post("/api/generate", json={"model": "nope"}, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 404 and KEY not in r.text
            assert KEY not in served.log()


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.5")
    assert not is_loopback("example.org")


@pytest.mark.parametrize(("host", "key", "warned"), [("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False)])
async def test_a_public_address_without_a_key_logs_a_warning(
    model_store: Path, caplog: pytest.LogCaptureFixture, host: str, key: str | None, warned: bool
) -> None:
    with caplog.at_level(logging.WARNING, logger="trioshed.server"), trio.fail_after(30):
        async with open_test_server(model_store, host=host, api_key=key):
            pass
    warnings = [r for r in caplog.records if "without TRIOSHED_API_KEY" in r.getMessage()]
    assert bool(warnings) is warned
    assert all(KEY not in r.getMessage() for r in caplog.records)


def test_store_paths_stay_in_the_store_unless_named_or_allowed(tmp_path: Path, tiny_model: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    outside = tmp_path / "elsewhere.gguf"
    os.link(tiny_model, outside)
    (store / "linked.gguf").symlink_to(outside)
    (store / "inner.gguf").symlink_to(store / "real.gguf")
    os.link(tiny_model, store / "real.gguf")
    strict = ModelStore(store)
    with pytest.raises(Forbidden, match="outside the model store"):
        strict.resolve("linked")
    assert strict.resolve("inner").name == "inner:latest"  # a link within the store is fine
    assert {s.name for s in strict.list()} == {"inner:latest", "real:latest"}
    assert strict.links_out() == [store / "linked.gguf"]  # what start-up warns about
    assert ModelStore(store, allow_symlinks=True).links_out() == []
    assert ModelStore(store, allow_symlinks=True).resolve("linked").path == str(store / "linked.gguf")
    (store / "models.toml").write_text(f'[models.named]\npath = "{outside}"\n')
    assert ModelStore(store).resolve("named").path == str(outside)  # models.toml may name any path


async def test_a_401_decided_before_the_body_arrived_keeps_the_connection_usable(model_store: Path) -> None:
    """The answer is ready from the headers alone; the body comes 0.3 s later. The connection
    stays usable for the next request (it was closed under the client's feet)."""
    body = b'{"model": "tiny"}'
    head = b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key=KEY) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))
            async with stream:
                await stream.send_all(head)
                await trio.sleep(0.3)
                await stream.send_all(body)
                answer = b""
                while b"API key" not in answer:
                    answer += await stream.receive_some(4096)
                assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" not in answer.lower()
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
                answer = b""
                while b"Ollama is running" not in answer:
                    chunk = await stream.receive_some(4096)
                    assert chunk, "the server closed the connection"
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200")


async def test_start_up_says_which_store_files_are_links_out_of_it(
    model_store: Path, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path / "elsewhere.gguf"
    os.link(tiny_model, outside)
    (model_store / "linked.gguf").symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="trioshed.server"), trio.fail_after(30):
        async with open_test_server(model_store):
            pass
    warnings = [r.getMessage() for r in caplog.records if "symlinks out of the store" in r.getMessage()]
    assert len(warnings) == 1 and str(model_store / "linked.gguf") in warnings[0], warnings
    assert "TRIOSHED_ALLOW_SYMLINKS=1" in warnings[0]
