"""The HTTP edge without loading models: auth, CORS, size limits, listings, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio

from trioshed import OLLAMA_API_VERSION, __version__
from trioshed.config import Settings
from trioshed.testing.server import open_test_server


async def test_api_key_is_required_when_set(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key="s3cret") as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/")).status_code == 200  # liveness stays open
            r = await http.get("/api/tags")
            assert r.status_code == 401 and "API key" in r.json()["error"]
            r = await http.get("/api/tags", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = await http.get("/api/tags", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and [m["name"] for m in r.json()["models"]] == ["tiny:latest"]


async def test_cors_allows_local_and_configured_origins_only(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store, origins=("https://app.example",)) as server, httpx.AsyncClient(
            base_url=server.base_url
        ) as http:
            for origin, allowed in (("http://localhost:3000", True), ("https://app.example", True), ("https://evil.example", False)):
                r = await http.get("/api/version", headers={"Origin": origin})
                assert (r.headers.get("Access-Control-Allow-Origin") == origin) is allowed, origin
            r = await http.options("/api/chat", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
            assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


async def test_oversized_body_is_413_and_closes_the_connection(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/api/generate", content=b"x" * (Settings().max_body + 1), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.headers["Connection"] == "close" and "error" in r.json()
            assert (await http.get("/api/version")).status_code == 200  # the client goes on


async def test_show_reports_metadata_and_estimate(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/api/show", json={"model": "tiny"})
            info = r.json()["model_info"]
            assert r.status_code == 200 and info["general.architecture"] == "llama"
            assert info["trioshed.estimate.total"] >= info["trioshed.estimate.weights"] > 0
            assert r.json()["details"]["family"] == "llama"
            assert (await http.post("/api/show", json={"model": "nope"})).status_code == 404


async def test_metrics_and_empty_ps(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/api/ps")).json() == {"models": []}
            text = (await http.get("/metrics")).text
            assert "trioshed_queued_requests 0" in text and "trioshed_loads_total 0" in text
            assert "trioshed_room_waits_total 0" in text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "tiny", "messages": "hi"}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"model": "tiny", "prompt": "x", "options": [1]}, "options"),
        ({"prompt": "x"}, "model"),
    ],
)
async def test_bad_requests_are_400_with_a_reason(model_store: Path, body: dict[str, object], needle: str) -> None:
    path = "/api/chat" if "messages" in body else "/api/generate"
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post(path, content=json.dumps(body))
            assert r.status_code == 400 and needle in r.json()["error"], r.text
            assert server.scheduler.statistics().loads == 0  # refused before any load


async def test_a_file_that_is_not_a_gguf_is_a_clear_500(model_store: Path) -> None:
    (model_store / "junk.gguf").write_bytes(b"this is not a model")
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/api/generate", json={"model": "junk", "prompt": "x"})
            assert r.status_code == 500 and "not a GGUF file" in r.json()["error"], r.text
            tags = (await http.get("/api/tags")).json()["models"]  # still listed, without details
            assert {m["name"] for m in tags} == {"junk:latest", "tiny:latest"}


async def test_api_version_is_the_ollama_api_served_and_trioshed_its_own(model_store: Path) -> None:
    # Ollama's clients read "version" as Ollama's: Codex --oss needs 0.13.4 or newer for its
    # /v1/responses (and accepts the development build's 0.0.0)
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            answer = (await http.get("/api/version")).json()
    assert answer == {"version": OLLAMA_API_VERSION, "trioshed_version": __version__}
    assert tuple(int(n) for n in answer["version"].split(".")) >= (0, 14, 0)
