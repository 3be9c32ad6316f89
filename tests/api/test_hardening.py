"""What a careless client sends must not break trioshed for everyone: types Ollama
refuses, keep-alives beyond any clock."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.api.routes.ollama_models import rfc3339
from trioshed.config_values import LONGEST_DURATION, parse_duration
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.usefixtures("no_leaked_runner")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/generate", {"prompt": {}}), ("/api/generate", {"prompt": []}), ("/api/generate", {"prompt": False}),
        ("/api/generate", {"prompt": 0}), ("/api/generate", {"suffix": {}}), ("/api/generate", {"think": "x"}),
        ("/api/chat", {"messages": {}}), ("/api/chat", {"messages": "hi"}), ("/api/chat", {"messages": False}),
        ("/api/chat", {"think": "x"}), ("/api/chat", {"messages": [], "think": 3}),
        ("/api/embed", {"input": {}}), ("/api/embed", {"input": 0}), ("/api/embed", {"input": False}),
        ("/api/embed", {"input": [1, 2]}),
    ],
)  # fmt: skip
async def test_the_types_ollama_refuses_are_400_and_load_nothing(model_store: Path, path: str, body: dict[str, Any]) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            r = await http.post(path, json={"model": "tiny", **body})
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            assert (await http.get("/api/ps")).json() == {"models": []}


def test_keep_alives_beyond_any_clock_are_forever() -> None:
    for value in (1e308, "1e308", "9999999999h", LONGEST_DURATION, float("inf"), -1, "-1m"):
        assert parse_duration(value) == math.inf, value
    assert parse_duration("99999h") == 99999 * 3600.0  # long, but a time
    assert parse_duration(0) == 0.0
    assert rfc3339(math.inf) == rfc3339(1e300) == rfc3339(2e10) == "2318-01-01T00:00:00Z"


async def test_a_huge_keep_alive_never_breaks_the_listing(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            for keep_alive in (1e308, "9999999999h", "99999h"):
                assert (await http.post("/api/generate", json={"model": "tiny", "keep_alive": keep_alive})).status_code == 200
                r = await http.get("/api/ps")
                assert r.status_code == 200, (keep_alive, r.text)
                [model] = r.json()["models"]
                assert model["name"] == "tiny:latest" and model["expires_at"].startswith(("2318-", "2038-", "2037-"))


async def test_errors_name_the_model_never_its_path_nor_its_bytes(
    model_store: Path, tmp_path: Path, unknown_arch_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "private" / "hostname"
    secret.parent.mkdir()
    secret.write_bytes(b"vm\nsecret-host-name\n")
    os.link(unknown_arch_model, model_store / "broken.gguf")
    (model_store / "models.toml").write_text(f'[models.notgguf]\npath = "{secret}"\n')
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            for path, body in (("/api/show", {"model": "notgguf"}), ("/api/generate", {"model": "notgguf", "prompt": "x"}),
                               ("/api/generate", {"model": "notgguf"}), ("/v1/chat/completions",
                               {"model": "notgguf", "messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
                r = await http.post(path, json=body)
                assert r.status_code == 500 and "cannot read model 'notgguf:latest': not a GGUF file" in r.text, (path, r.text)
                assert str(tmp_path) not in r.text and "vm" not in r.text and "secret" not in r.text, r.text
            # llama-server's own words stay (what to fix), the path of the file does not (which of
            # its last lines arrive before it exits varies: its log is written by a thread)
            r = await http.post("/api/generate", json={"model": "broken", "prompt": "x"})
            assert r.status_code == 500 and "before it was ready" in r.text and "'broken:latest'" in r.text, r.text
            assert str(model_store) not in r.text and str(tmp_path) not in r.text, r.text
    assert any(str(secret) in rec.getMessage() for rec in caplog.records)  # the details are logged


async def test_an_unexpected_error_is_a_500_that_echoes_nothing(
    model_store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: object, spec: object) -> object:
        raise RuntimeError("/very/secret/path starts with b'vm\\n'")

    monkeypatch.setattr("trioshed.api.state.AppState.metadata", broken)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            r = await http.post("/api/show", json={"model": "tiny"})
            assert r.status_code == 500 and "internal error" in r.json()["error"]
            assert "secret" not in r.text and "vm" not in r.text
    assert any("/very/secret/path" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


@pytest.mark.parametrize("where", ["/proc/no-such-store", "a-regular-file"])
def test_an_unusable_store_is_one_line_naming_the_setting(tmp_path: Path, where: str) -> None:
    store = tmp_path / where if not where.startswith("/") else Path(where)
    if where == "a-regular-file":
        store.write_text("not a folder")
    env = {**os.environ, "TRIOSHED_MODELS": str(store), "TRIOSHED_HOST": f"127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-m", "trioshed", "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"Error: TRIOSHED_MODELS: {store}: "), line


@pytest.mark.slow
async def test_logging_to_a_full_disk_never_stops_serving(model_store: Path) -> None:
    port = free_port()
    env = {**os.environ, "TRIOSHED_MODELS": str(model_store), "TRIOSHED_HOST": f"127.0.0.1:{port}", "TRIOSHED_NUM_THREAD": "1"}
    full = os.open("/dev/full", os.O_WRONLY)  # every write fails with ENOSPC
    try:
        process = await trio.lowlevel.open_process([sys.executable, "-m", "trioshed", "serve"], env=env, stdout=full, stderr=full)
    finally:
        os.close(full)
    try:
        with trio.fail_after(60):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                while True:
                    assert process.poll() is None, f"trioshed exited with {process.returncode}"
                    try:
                        if (await http.get("/")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await trio.sleep(0.05)
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
                assert r.status_code == 200
                assert (await http.post("/api/generate", json={"model": "nope"})).status_code == 404  # a warning line
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.poll() is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
