"""Speculative decoding against the real binary: at temperature 0 the tokens with n-gram
speculation are the tokens without, on every protocol, streamed or not, on the template path
(a model with a chat template) and the transcript path (Gemma 3 270M, a base model), and equal
to llama-server run alone; usage counts generated tokens, not drafted ones; drafted and accepted
tokens show in /api/ps and /metrics. A draft model is placed with its target and goes with it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

CODE = '''def fits(est, device, overhead):
    """Whether a model fits on a device."""
    usable = max(0, device.free - overhead)
    return est.total <= usable


def place(est, devices, overhead=0):
    for device in devices:
        if fits(est, device, overhead):
            return device
    return None
'''
#: A base model continues a third copy of the code: n-gram drafting finds it in the prompt.
ASK = "# a.py\n" + CODE + "\n# b.py, a copy of a.py\n" + CODE + "\n# c.py, a copy of a.py\n"
N = 48


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def _store(tmp_path: Path, model: Path, name: str = "models") -> Path:
    store = tmp_path / name
    store.mkdir()
    (store / "models.toml").write_text(
        f'[models.spec]\npath = {json.dumps(str(model))}\nspeculation = "ngram"\n\n'
        f'[models.plain]\npath = {json.dumps(str(model))}\nspeculation = "off"\n'
    )
    return store


async def _answers(base_url: str, model: str) -> dict[str, Any]:
    """The same requests on every protocol; text and generated-token counts."""
    out: dict[str, Any] = {}
    ol = ollama.Client(host=base_url)
    opts = {"temperature": 0, "num_predict": N}
    raw = await in_thread(ol.generate, model=model, prompt=ASK, raw=True, options=opts)
    out["ollama raw"] = (raw.response, raw.eval_count)
    assert raw.eval_duration and raw.eval_duration > 0
    gen = await in_thread(ol.generate, model=model, prompt=ASK, options=opts)
    out["ollama generate"] = (gen.response, gen.eval_count)
    chunks = await in_thread(lambda: list(ol.chat(model=model, messages=[{"role": "user", "content": ASK}], options=opts, stream=True)))
    out["ollama chat stream"] = ("".join(c.message.content or "" for c in chunks), chunks[-1].eval_count)
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": ASK}]
    chat = await in_thread(oai.chat.completions.create, model=model, messages=msgs, temperature=0, max_tokens=N)
    out["openai chat"] = (chat.choices[0].message.content, chat.usage.completion_tokens if chat.usage else None)

    def streamed() -> tuple[str, int | None]:
        events = list(oai.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=N, stream=True,
                                                  stream_options={"include_usage": True}))  # fmt: skip
        text = "".join((e.choices[0].delta.content or "") for e in events if e.choices)
        return text, events[-1].usage.completion_tokens if events[-1].usage else None

    out["openai chat stream"] = await in_thread(streamed)
    comp = await in_thread(oai.completions.create, model=model, prompt=ASK, temperature=0, max_tokens=N)
    out["openai completions"] = (comp.choices[0].text, comp.usage.completion_tokens if comp.usage else None)
    ant = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    msg = await in_thread(ant.messages.create, model=model, max_tokens=N, extra_body={"temperature": 0}, messages=msgs)
    out["anthropic"] = ("".join(b.text for b in msg.content if b.type == "text"), msg.usage.output_tokens)
    return out


async def _ps(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as http:
        return {m["name"]: m for m in (await http.get(f"{base_url}/api/ps")).json()["models"]}


async def _metric(base_url: str, name: str, model: str) -> float:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{base_url}/metrics")).text
    m = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return float(m[1]) if m else -1.0


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_same_tokens_on_every_protocol_transcript_path(tmp_path: Path, gemma_model: Path) -> None:
    store = _store(tmp_path, gemma_model)
    with trio.fail_after(420):
        async with open_test_server(store, context_length=2048, num_parallel=1) as server:
            spec = await _answers(server.base_url, "spec")
            # Read before the plain model's load, which may evict this runner on a busy machine.
            ps = await _ps(server.base_url)
            stats = ps["spec:latest"]["runner"]["speculation_stats"]
            assert ps["spec:latest"]["runner"]["speculation"] == "ngram"
            assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
            assert await _metric(server.base_url, "trioshed_speculative_drafted_tokens_total", "spec:latest") == stats["drafted"]
            assert await _metric(server.base_url, "trioshed_speculative_accepted_tokens_total", "spec:latest") == stats["accepted"]
            plain = await _answers(server.base_url, "plain")
            ps = await _ps(server.base_url)
            assert "speculation_stats" not in ps["plain:latest"]["runner"]
            assert ps["plain:latest"]["runner"]["speculation"] == "off"
            for route, (text, count) in spec.items():
                assert (text, count) == plain[route], route
                assert count is not None and 0 < count <= N, route
            # Usage counts generated tokens: an answer cut by the limit has exactly N.
            assert spec["ollama raw"][1] == N and spec["openai completions"][1] == N
            assert "        if fits(est, device, overhead):" in spec["ollama raw"][0]  # it repeats: drafting pays
    # llama-server alone, no speculation: the same tokens as trioshed's speculating runner.
    args = ["-t", "1", "--device", "none", "-ngl", "0", "-c", "2048", "-np", "1", "--fit", "off"]
    with running_llama_server(gemma_model, args, timeout=120) as direct:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            body = {"prompt": ASK, "max_tokens": N, "temperature": 0}
            alone = (await http.post(f"{direct.url}/v1/completions", json=body)).json()
    assert (alone["choices"][0]["text"], alone["usage"]["completion_tokens"]) == spec["openai completions"]


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_same_tokens_on_the_template_path(tmp_path: Path) -> None:
    """A model with a chat template (a tiny random one, low end-of-sequence): the chat routes go
    through llama-server's template; speculation on or off, the same tokens."""
    model = write_tiny_model(tmp_path / "tiny.gguf", n_embd=64, n_layer=2, seed=11)
    store = _store(tmp_path, model)
    with trio.fail_after(240):
        async with open_test_server(store, context_length=1024, num_parallel=1) as server:
            spec = await _answers(server.base_url, "spec")
            plain = await _answers(server.base_url, "plain")
            assert spec == plain
            assert all(count is not None and count > 0 for _, count in spec.values())
