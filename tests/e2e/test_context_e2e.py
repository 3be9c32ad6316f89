"""The runner's context end to end: clamped to the model's trained context, sized per request,
and a prompt too long for it answered in each protocol's words before any answer starts.

Real llama-server children (a tiny model trained on 256 tokens), the official ``ollama``,
``openai`` and ``anthropic`` clients in worker threads, real clock with ``fail_after`` guards.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

TRAINED = 256
LONG = "hello world " * 300  # far more than 256 tokens in any vocabulary
SHORT = "hi"


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_model(folder / "short.gguf", context_length=TRAINED)
    return folder


async def test_context_is_clamped_and_too_long_gets_each_protocols_error(store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trioshed.scheduler.scheduler")
    with trio.fail_after(180):
        async with open_test_server(store) as server:
            base = server.base_url
            oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
            ol = ollama.Client(host=base)

            # A short request: served, by a runner at the trained context (not 4096).
            ok = await in_thread(oa.chat.completions.create, model="short", max_tokens=2,
                                 messages=[{"role": "user", "content": SHORT}])  # fmt: skip
            assert ok.choices[0].message is not None
            ps = (await in_thread(ol.ps)).models
            assert [m.context_length for m in ps] == [TRAINED]
            shown = await in_thread(ol.show, "short")
            assert shown.modelinfo is not None and shown.modelinfo["trioshed.estimate.num_ctx"] == TRAINED
            assert any("context 256 tokens per slot" in r.getMessage() for r in caplog.records)
            # A request asking for more than the model was trained on is clamped, not reloaded.
            await in_thread(ol.generate, model="short", prompt=SHORT, options={"num_ctx": 8192, "num_predict": 1})
            assert [m.context_length for m in (await in_thread(ol.ps)).models] == [TRAINED]

            # Too long: OpenAI's context_length_exceeded, streamed or not.
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as oe:
                    await in_thread(oa.chat.completions.create, model="short", max_tokens=2, stream=stream,
                                    messages=[{"role": "user", "content": LONG}])  # fmt: skip
                err = oe.value.body
                assert isinstance(err, dict) and err["code"] == "context_length_exceeded", err
                assert f"maximum context length is {TRAINED} tokens" in err["message"]
                assert "llama-server" not in err["message"]
            with pytest.raises(openai.BadRequestError) as oe:
                await in_thread(oa.completions.create, model="short", max_tokens=2, prompt=LONG)
            assert isinstance(oe.value.body, dict) and oe.value.body["code"] == "context_length_exceeded"

            # Anthropic's invalid_request_error, "prompt is too long: N tokens > M maximum".
            def streamed() -> None:
                with an.messages.stream(model="short", max_tokens=2, messages=[{"role": "user", "content": LONG}]) as s:
                    list(s)

            for call in (
                lambda: an.messages.create(model="short", max_tokens=2, messages=[{"role": "user", "content": LONG}]),
                streamed,
            ):
                with pytest.raises(anthropic.BadRequestError) as ae:
                    await in_thread(call)
                body = ae.value.body
                assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
                assert body["error"]["message"].startswith("prompt is too long: ")
                assert body["error"]["message"].endswith(f" tokens > {TRAINED} maximum")

            # Ollama's words, on chat and generate, streamed or not.
            for call in (
                lambda: ol.chat(model="short", messages=[{"role": "user", "content": LONG}], options={"num_predict": 2}),
                lambda: list(ol.chat(model="short", messages=[{"role": "user", "content": LONG}], stream=True)),
                lambda: ol.generate(model="short", prompt=LONG, options={"num_predict": 2}),
                lambda: list(ol.generate(model="short", prompt=LONG, stream=True)),
            ):
                with pytest.raises(ollama.ResponseError) as oe2:
                    await in_thread(call)
                assert oe2.value.status_code == 400
                assert oe2.value.error.startswith("the input length exceeds the context length (")
                assert "llama-server" not in oe2.value.error

            # A request whose byte count exceeds the context but whose tokens fit is served.
            fits = "hi " * 60
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                r = await http.post("/api/generate", json={"model": "short", "prompt": fits, "stream": False,
                                                           "options": {"num_predict": 1}})  # fmt: skip
                assert r.status_code == 200, r.text
            stats = server.scheduler.statistics()
            assert len(stats.runners) == 1 and stats.runners[0].context_length == TRAINED  # never reloaded


async def test_a_loaded_runner_counts_before_the_context_grows(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_model(folder / "wide.gguf", context_length=16384)
    record: list[tuple[str, str]] = []
    with trio.fail_after(180):
        async with open_test_server(folder, record=record) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            async def tokens(text: str) -> int:
                r = await http.post("/tokenize", json={"model": "wide", "content": text})
                assert r.status_code == 200, r.text
                return len(r.json()["tokens"])

            async def generate(text: str) -> httpx.Response:
                return await http.post("/api/generate", json={"model": "wide", "prompt": text, "stream": False,
                                                              "raw": True, "options": {"num_predict": 1}})  # fmt: skip

            assert (await generate(SHORT)).status_code == 200
            assert [r.context_length for r in server.scheduler.statistics().runners] == [4096]
            # Counted on the loaded runner (its bound would load the model at 16384): refused
            # in Ollama's words, and nothing loads.
            huge = "hello world " * 12000
            r = await generate(huge)
            assert r.status_code == 400 and r.json()["error"].startswith("the input length exceeds the context length (")
            assert r.json()["error"].endswith(" tokens > 16384 maximum)")
            assert [e for e in record if e[0] == "load"] == [("load", "wide")]  # refused without a load
            # Tokenizing and rendering need no context: the loaded runner serves them, however
            # long the text (its bound would load the model at 16384 otherwise).
            assert (await tokens(huge)) > 16384
            r = await http.post("/apply-template", json={"model": "wide", "messages": [{"role": "user", "content": huge}]})
            assert r.status_code == 200 and huge in r.json()["prompt"]
            r = await http.post("/detokenize", json={"model": "wide", "tokens": [5] * 6000})
            assert r.status_code == 200, r.text
            assert [e for e in record if e[0] == "load"] == [("load", "wide")]
            assert [r.context_length for r in server.scheduler.statistics().runners] == [4096]


async def test_a_keep_alive_0_request_counted_on_the_loaded_runner_loads_its_model_once(tmp_path: Path) -> None:
    """Counting a prompt on the loaded runner is no request of its own: a ``keep_alive: 0``
    request whose bound would reload the model bigger is counted there, served there (the model
    is not stopped by the count and loaded again), and unloaded after its answer."""
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_model(folder / "wide.gguf", context_length=16384)
    with trio.fail_after(180):
        async with open_test_server(folder) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            first = await http.post("/api/generate", json={"model": "wide", "prompt": SHORT, "stream": False,
                                                           "options": {"num_predict": 1}})  # fmt: skip
            assert first.status_code == 200, first.text
            assert [r.context_length for r in server.scheduler.statistics().runners] == [4096]
            # its bound (bytes, a template's markers, the output) asks 8192; its count fits 4096
            text = "hi " * 1363 + "h"
            r = await http.post("/tokenize", json={"model": "wide", "content": text})
            assert r.status_code == 200 and 4000 < len(r.json()["tokens"]) < 4094
            r = await http.post("/api/generate", json={"model": "wide", "prompt": text, "stream": False, "raw": True,
                                                       "keep_alive": 0, "options": {"num_predict": 1}})  # fmt: skip
            assert r.status_code == 200, r.text
            stats = await server.scheduler.wait_statistics(lambda s: not s.runners)  # keep_alive 0: unloaded after
            assert stats.loads == 1, stats  # never loaded again
            metrics = (await http.get("/metrics")).text
            assert "trioshed_loads_total 1.0" in metrics
