"""End to end with the tiny vision pair (``trioshed.testing.vision``): a folder holding a model
and its projector serves images with no configuration; each protocol's image request answers
what llama-server alone answers with the runner's own command line; the projector is never a
model; ``/api/ps`` counts the projector beside the model, as llama.cpp reports it."""

from __future__ import annotations

import base64
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.test_llama_tools_e2e import _runner_argv
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import tiny_png, write_tiny_vision_projector

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

PNG = [base64.b64encode(tiny_png(seed=s)).decode() for s in (0, 1)]
N = 6  # greedy tokens per answer
MiB = 1024 * 1024


@pytest.fixture
def vision_store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    write_tiny_model(store / "tiny.gguf")
    shutil.copy(store / "tiny.gguf", store / "text.gguf")  # the same model, without a projector
    write_tiny_vision_projector(store / "mmproj-tiny-f16.gguf")
    return store


def _url(image: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}


#: (route, body through trioshed, the OpenAI chat messages llama-server alone gets)
CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("/api/chat", {"messages": [{"role": "user", "content": "what is it?", "images": PNG[:1]}]},
     [{"role": "user", "content": [_url(PNG[0]), {"type": "text", "text": "what is it?"}]}]),
    ("/api/chat", {"messages": [{"role": "user", "content": "and these?", "images": PNG}]},
     [{"role": "user", "content": [_url(PNG[0]), _url(PNG[1]), {"type": "text", "text": "and these?"}]}]),
    ("/api/generate", {"prompt": "describe", "images": PNG[1:]},
     [{"role": "user", "content": [_url(PNG[1]), {"type": "text", "text": "describe"}]}]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _url(PNG[0])]}]},
     [{"role": "user", "content": [{"type": "text", "text": "hi"}, _url(PNG[0])]}]),
    ("/v1/messages", {"max_tokens": N, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG[1]}},
        {"type": "text", "text": "look"}]}]},
     [{"role": "user", "content": [_url(PNG[1]), {"type": "text", "text": "look"}]}]),
]  # fmt: skip


def _ours(route: str, body: dict[str, Any]) -> dict[str, Any]:
    if route.startswith("/api/"):
        return {**body, "model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": N}}
    return {**body, "model": "tiny", "temperature": 0, "max_tokens": N}


def _answer(route: str, r: httpx.Response) -> tuple[int, int, str]:
    """(status, prompt tokens, text) of an answer in its protocol's shape."""
    d = r.json()
    if route == "/api/chat":
        return r.status_code, d["prompt_eval_count"], d["message"]["content"]
    if route == "/api/generate":
        return r.status_code, d["prompt_eval_count"], d["response"]
    if route == "/v1/messages":
        usage = d["usage"]  # input_tokens leaves out what the prompt cache read
        return r.status_code, usage["input_tokens"] + usage.get("cache_read_input_tokens", 0), d["content"][0]["text"]
    return r.status_code, d["usage"]["prompt_tokens"], d["choices"][0]["message"]["content"]


def _load_buffers(records: list[logging.LogRecord], pid: int) -> float:
    """Bytes llama.cpp reported allocating while child ``pid`` loaded: every ``buffer size``
    line and the projector's ``model size``, up to the moment it listened."""
    total = 0.0
    for r in records:
        line = r.getMessage()
        if r.name != "trioshed.runner.output" or f"[{pid}] " not in line:
            continue
        if "listening on" in line:
            break
        if m := re.search(r"(?:buffer size =|load_hparams: model size:) +([0-9.]+) MiB", line):
            total += float(m[1]) * MiB
    return total


async def test_a_folder_of_a_model_and_its_projector_serves_images(vision_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    with trio.fail_after(180):
        async with open_test_server(vision_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            tags = (await http.get("/api/tags")).json()["models"]
            assert sorted(m["name"] for m in tags) == ["text:latest", "tiny:latest"]  # never the projector
            assert sorted(m["id"] for m in (await http.get("/v1/models")).json()["data"]) == ["text", "tiny"]
            show = (await http.post("/api/show", json={"model": "tiny"})).json()
            assert "vision" in show["capabilities"]
            assert show["projector_info"]["general.architecture"] == "clip"
            assert show["projector_info"]["clip.projector_type"] == "gemma3"
            assert show["model_info"]["trioshed.estimate.projector"] > (vision_store / "mmproj-tiny-f16.gguf").stat().st_size
            assert "projector_info" not in (await http.post("/api/show", json={"model": "text"})).json()
            for route in ("/api/chat", "/v1/chat/completions"):  # the projector is not a model
                r = await http.post(route, json={"model": "mmproj-tiny-f16", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 404, r.text
            ours = [_answer(route, await http.post(route, json=_ours(route, body))) for route, body, _ in CASES]
            argv = _runner_argv()
            (ps,) = (await http.get("/api/ps")).json()["models"]
            (stats,) = server.scheduler.statistics().runners
            assert stats.pid is not None and ps["runner"]["size_source"] == "measured"
            reported = _load_buffers(caplog.records, stats.pid)
            assert ps["size"] == pytest.approx(reported, rel=0.03), (ps["size"], reported)
            await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
            await http.post("/api/generate", json={"model": "text", "prompt": "hi", "options": {"num_predict": 1}, "stream": False})
            (text_ps,) = (await http.get("/api/ps")).json()["models"]
            assert ps["size"] >= text_ps["size"] + (vision_store / "mmproj-tiny-f16.gguf").stat().st_size * 0.9
    assert "--mmproj" in argv
    assert all(status == 200 and text for status, _, text in ours), ours

    def alone() -> list[tuple[int, int, str]]:
        out = []
        with running_llama_server(vision_store / "tiny.gguf", argv) as llama:
            for _, _, messages in CASES:
                r = httpx.post(f"{llama.url}/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": N}, timeout=60)
                d = r.json()
                out.append((r.status_code, d["usage"]["prompt_tokens"], d["choices"][0]["message"]["content"]))
        return out

    assert ours == await trio.to_thread.run_sync(alone)


async def test_a_vision_runner_unloads_quietly_with_warm_returns_on(vision_store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """llama-server saves only slots of pure text: a slot holding an image is skipped without a
    warning, counted, and the runner says so in ``/api/ps``."""
    caplog.set_level(logging.INFO, logger="trioshed.runner.slots")
    settings = {"kv_cache_dir": tmp_path / "kv", "kv_cache_budget": 64 * MiB, "max_loaded_models": 1}
    with trio.fail_after(120):
        async with open_test_server(vision_store, **settings) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            route, body, _ = CASES[0]
            assert (await http.post(route, json=_ours(route, body))).status_code == 200
            (ps,) = (await http.get("/api/ps")).json()["models"]
            assert "image" in ps["runner"]["warm_returns"]
            await http.post("/api/generate", json={"model": "text", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
            assert server.state.warm is not None
            stats = server.state.warm.statistics()
    assert (stats.saves, stats.saves_skipped, stats.save_failures) == (0, 1, 0), stats
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert any("image or audio" in r.getMessage() for r in caplog.records)
