"""The automatic context made smaller to fit the memory, end to end through the real API.

Real llama-server children (tiny models trained on 32,768 tokens, every layer asked on the GPU
with ``num_gpu`` in models.toml) on a declared GPU sized from the server's own estimates: the
context of 4,096 fits, 8,192 does not. The request's upper bound (a byte per token) asks for
8,192; the exact count with the smaller runner decides: served (200, /api/ps shows 4,096), or a
507 in each protocol's own shape, never llama-server's words. A wider model whose 4,096 does not
fit either gets the plain 507. The official ``ollama``, ``openai`` and ``anthropic`` clients in
worker threads; the real clock with ``fail_after`` guards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from trioshed.api.pipeline.preamble import request_need
from trioshed.core.context import bucket
from trioshed.core.model import Device
from trioshed.core.placement import place
from trioshed.models.store import ModelStore
from trioshed.server import estimate_model
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

TRAINED = 32768
#: A raw prompt whose bound (4,070 bytes, its keys, the per-message allowance and the 8 tokens
#: asked for) passes 4,096 while its exact count (a byte per token, with BOS and "▁": 4,072)
#: leaves room for the 8 tokens in 4,096: the bound's bucket is 8,192, the request's is 4,096.
FITS = {"prompt": "x" * 4070, "raw": True, "stream": False, "options": {"num_predict": 8, "temperature": 0}}
#: A prompt of 6,000 tokens: more than 4,096 holds, less than the 8,192 that does not fit.
TOO_LONG = "x" * 6000


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_model(folder / "t.gguf", context_length=TRAINED)
    write_tiny_model(folder / "wide.gguf", context_length=TRAINED, n_embd=256, n_layer=4, seed=1)
    write_tiny_model(folder / "short.gguf", context_length=8192, seed=2)  # "t"'s shape, trained on 8,192
    (folder / "models.toml").write_text(
        "".join(f'[models.{name}]\npath = "{name}.gguf"\noptions = {{ num_gpu = 99 }}\n' for name in ("t", "wide", "short"))
    )
    return folder


async def gpu_between(store: Path) -> Device:
    """A declared GPU where "t" fits at 4,096 but not at 8,192 (and "wide" not even at 4,096),
    from the options and estimates a server gives these models."""
    async with open_test_server(store, cache_ram=0) as probe:
        big = Device("cuda:0", "cuda", 0, 1 << 40, 1 << 40)

        def vram(name: str, need: int) -> int:
            spec = ModelStore(store).resolve(name)
            options = probe.state.runner_options(spec, {"num_gpu": 99}, need=need)
            placed = place(estimate_model(spec, options), [big], system_free=1 << 40, num_gpu=99)
            assert not hasattr(placed, "reason"), placed
            return placed.vram_total  # type: ignore[union-attr]

        small, large, wide = vram("t", 4096), vram("t", 8192), vram("wide", 4096)
    assert small < large and small < wide, (small, large, wide)
    size = (small + min(large, wide)) // 2
    return Device("cuda:0", "cuda", 0, size, size)


async def test_a_bound_that_does_not_fit_is_served_at_the_smaller_context_the_request_needs(store: Path) -> None:
    assert bucket(request_need(FITS)) == 8192  # the bound's bucket...
    with trio.fail_after(240):
        gpu = await gpu_between(store)
        record: list[tuple[str, str]] = []
        async with open_test_server(store, devices=(gpu,), cache_ram=0, record=record) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            answer = await http.post("/api/generate", json={"model": "t", **FITS})
            assert answer.status_code == 200, answer.text
            assert answer.json()["done"] is True and answer.json()["eval_count"] == 8
            ps = (await http.get("/api/ps")).json()["models"]
            assert [(m["name"], m["context_length"]) for m in ps] == [("t:latest", 4096)]  # ...is not what loaded
            assert ("smaller context", "t") in record
            assert [e for e in record if e[0] == "load"] == [("load", "t")]  # 8,192 was never tried

            # counted on the loaded runner: 6,000 tokens need 8,192, which does not fit: a 507,
            # and the runner that fits stays loaded
            ol = ollama.Client(host=server.base_url)
            with pytest.raises(ollama.ResponseError) as oe:
                await in_thread(ol.generate, model="t", prompt=TOO_LONG, raw=True, options={"num_predict": 8})
            assert oe.value.status_code == 507
            assert "at a context of 8,192 tokens" in oe.value.error and "GiB" in oe.value.error
            assert "llama-server" not in oe.value.error
            ps = (await http.get("/api/ps")).json()["models"]
            assert [(m["name"], m["context_length"]) for m in ps] == [("t:latest", 4096)]
            assert ("evict", "t") not in record

            # Longer than the model takes: still the 400 of a prompt too long for the trained
            # context, though its runner was made smaller to fit (its 8,192 does not either).
            oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as xe:
                await in_thread(oa.chat.completions.create, model="short", max_tokens=2,
                                messages=[{"role": "user", "content": "x" * 9000}])  # fmt: skip
            assert isinstance(xe.value.body, dict) and xe.value.body["code"] == "context_length_exceeded"
            assert "maximum context length is 8192 tokens" in xe.value.body["message"]
            ps = (await http.get("/api/ps")).json()["models"]
            assert ("short:latest", 4096) in [(m["name"], m["context_length"]) for m in ps]


async def test_nothing_fits_is_a_507_in_each_protocols_shape(store: Path) -> None:
    with trio.fail_after(240):
        gpu = await gpu_between(store)
        async with open_test_server(store, devices=(gpu,), cache_ram=0) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:
            base = server.base_url
            ol = ollama.Client(host=base)
            oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
            chat = [{"role": "user", "content": TOO_LONG}]

            async def unload() -> None:
                await in_thread(ol.generate, model="t", keep_alive=0)
                assert (await http.get("/api/ps")).json()["models"] == []

            def smaller_context_words(message: str) -> None:
                assert "requires more memory than is available" in message, message
                assert "the largest context that fits is 4,096 tokens (8,192 tokens: an estimated" in message
                assert "llama-server" not in message

            # Not loaded: the bound's 8,192 does not fit, 4,096 loads, and the exact count is
            # more than it holds: a 507 naming the prompt's tokens and the memory.
            with pytest.raises(ollama.ResponseError) as oe:
                await in_thread(ol.chat, model="t", messages=chat, options={"num_predict": 8})
            assert oe.value.status_code == 507
            smaller_context_words(oe.value.error)
            raw = await http.post("/api/chat", json={"model": "t", "messages": chat, "stream": True})
            assert raw.status_code == 507 and set(raw.json()) == {"error"}
            await unload()

            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as xe:
                    await in_thread(oa.chat.completions.create, model="t", messages=chat, max_tokens=8, stream=stream)
                assert xe.value.status_code == 507
                body = xe.value.body
                assert isinstance(body, dict) and set(body) >= {"message", "type"}, body
                smaller_context_words(body["message"])
                await unload()

            with pytest.raises(openai.APIStatusError) as xe:  # the Responses API: the same route preamble
                await in_thread(oa.responses.create, model="t", input=TOO_LONG, max_output_tokens=16)
            assert xe.value.status_code == 507 and isinstance(xe.value.body, dict)
            smaller_context_words(xe.value.body["message"])
            await unload()

            def anthropic_stream() -> None:
                with an.messages.stream(model="t", max_tokens=8, messages=chat) as events:
                    list(events)

            for call in (lambda: an.messages.create(model="t", max_tokens=8, messages=chat), anthropic_stream):
                with pytest.raises(anthropic.APIStatusError) as ae:
                    await in_thread(call)
                assert ae.value.status_code == 507
                error = ae.value.body
                assert isinstance(error, dict) and error["type"] == "error" and set(error["error"]) == {"type", "message"}
                smaller_context_words(error["error"]["message"])
                await unload()

            # A model whose smallest context does not fit: the plain 507, nothing loaded.
            with pytest.raises(ollama.ResponseError) as oe:
                await in_thread(ol.generate, model="wide", prompt="hi", options={"num_predict": 2})
            assert oe.value.status_code == 507 and "at a context of 4,096 tokens" in oe.value.error
            with pytest.raises(openai.APIStatusError) as xe:
                await in_thread(oa.chat.completions.create, model="wide", max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            assert xe.value.status_code == 507 and isinstance(xe.value.body, dict)
            assert "at a context of 4,096 tokens" in xe.value.body["message"]
            with pytest.raises(anthropic.APIStatusError) as ae:
                await in_thread(an.messages.create, model="wide", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert ae.value.status_code == 507 and isinstance(ae.value.body, dict)
            assert "at a context of 4,096 tokens" in ae.value.body["error"]["message"]
            assert "llama-server" not in ae.value.body["error"]["message"]
            assert not [m for m in (await http.get("/api/ps")).json()["models"] if m["name"] == "wide:latest"]


async def test_a_bound_that_would_spill_to_system_memory_loads_smaller_and_grows_to_the_exact_count(
    store: Path,
) -> None:
    """Without num_gpu, what does not fit the GPU is split with system memory: the bound's 8,192
    would put layers there, 4,096 keeps them all on the GPU. A request that 4,096 holds is
    served there; one it does not is grown to the bucket of its exact count, split as it must."""
    gpu = await gpu_between(store)
    (store / "models.toml").unlink()
    with trio.fail_after(240):
        record: list[tuple[str, str]] = []
        async with open_test_server(store, devices=(gpu,), cache_ram=0, record=record) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:

            async def loaded() -> list[tuple[int, bool]]:
                models = (await http.get("/api/ps")).json()["models"]
                return [(m["context_length"], m["runner"]["n_gpu_layers"] == 3) for m in models]  # 2 layers + output

            answer = await http.post("/api/generate", json={"model": "t", **FITS})
            assert answer.status_code == 200, answer.text
            assert await loaded() == [(4096, True)]  # every layer on the GPU
            assert ("smaller context", "t") in record
            await http.post("/api/generate", json={"model": "t", "keep_alive": 0})
            assert await loaded() == []

            # Not loaded, 6,000 tokens: loaded at 4,096, counted there, grown to 8,192 (split).
            oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
            record.clear()
            stream = await in_thread(oa.completions.create, model="t", prompt=TOO_LONG, max_tokens=4, stream=True)
            chunks = await in_thread(list, stream)
            assert chunks and chunks[-1].choices[0].finish_reason == "length"
            assert await loaded() == [(8192, False)]
            assert [e for e in record if e[0] in ("load", "smaller context")] == [
                ("smaller context", "t"), ("load", "t"), ("load", "t"),
            ]  # fmt: skip


async def test_a_smaller_context_that_fits_beside_a_loaded_model_is_taken_before_evicting_it(store: Path) -> None:
    """A GPU where "t" fits at 4,096 beside a loaded "short", at 8,192 alone but not beside it:
    "t"'s bound asks 8,192 while "short" is loaded; 4,096 fits beside it and holds the request,
    so nothing is evicted (8,192 would spill layers to system memory)."""
    (store / "models.toml").unlink()
    # A loaded runner counts with what llama.cpp reported (its measured size, shared out over
    # the devices as planned): load "short" on a GPU first to learn its share there.
    big = Device("cuda:0", "cuda", 0, 1 << 40, 1 << 40)
    async with open_test_server(store, devices=(big,), cache_ram=0) as probe, httpx.AsyncClient(
        base_url=probe.base_url, timeout=60
    ) as http:
        first = await http.post("/api/generate", json={"model": "short", "prompt": "hi", "options": {"num_predict": 2}, "stream": False})
        assert first.status_code == 200
        (short,) = probe.scheduler.statistics().runners
        assert short.context_length == 4096 and short.size_vram > 0
        spec = ModelStore(store).resolve("t")
        sizes = []
        for need in (4096, 8192):
            options = probe.state.runner_options(spec, {}, need=need)
            placed = place(estimate_model(spec, options), [big], system_free=1 << 40)
            sizes.append(placed.vram_total)  # type: ignore[union-attr]
    small, large = sizes
    total = short.size_vram + (small + large) // 2
    assert short.size_vram + small <= total < short.size_vram + large and large <= total, (short.size_vram, small, large)
    gpu = Device("cuda:0", "cuda", 0, total, total)
    with trio.fail_after(240):
        record: list[tuple[str, str]] = []
        async with open_test_server(store, devices=(gpu,), cache_ram=0, record=record) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60
        ) as http:

            async def loaded() -> set[tuple[str, int]]:
                return {(m["name"], m["context_length"]) for m in (await http.get("/api/ps")).json()["models"]}

            first = await http.post("/api/generate", json={"model": "short", "prompt": "hi", "options": {"num_predict": 2}, "stream": False})
            assert first.status_code == 200
            answer = await http.post("/api/generate", json={"model": "t", **FITS})
            assert answer.status_code == 200, answer.text
            assert await loaded() == {("short:latest", 4096), ("t:latest", 4096)}
            assert ("evict", "short") not in record and ("smaller context", "t") in record

            # one that 4,096 does not hold: counted on the loaded runner, grown, evicting as it must
            longer = await http.post("/api/generate", json={"model": "t", "prompt": TOO_LONG, "raw": True,
                                                             "stream": False, "options": {"num_predict": 4}})  # fmt: skip
            assert longer.status_code == 200, longer.text
            assert await loaded() == {("t:latest", 8192)}
            assert ("evict", "short") in record
