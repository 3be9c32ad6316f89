"""Adapter groups end to end with real llama-server children (real clock, ``fail_after`` guards):
a base and its adapter-models served by one runner, each answer equal to llama-server run alone
with only that model's adapters, on every protocol's route; a group that grows under load."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.testing.adapters import write_lora
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

PROMPT = "Hello world, this is a longer prompt to compare"
MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]
N = 12
#: llama-server alone as trioshed starts it, where it matters for the tokens: one thread, flash
#: attention on (trioshed's choice on the CPU), no speculation.
ALONE = ["-t", "1", "--fit", "off", "-ngl", "0", "-np", "1", "-c", "1024", "-fa", "on", "--cache-ram", "0"]
TOML = """
[models.a1]
path = "alpha.gguf"
adapters = ["l1.gguf"]

[models.a2]
path = "alpha.gguf"
adapters = ["l2.gguf"]

[models.a3]
path = "alpha.gguf"
adapters = ["l3.gguf"]

[models.a4]
path = "alpha.gguf"
adapters = ["l4.gguf", { path = "l1.gguf", scale = 0.5 }]
"""
#: The adapters each model applies (llama-server alone: --lora-scaled), by model.
APPLIED: dict[str, list[tuple[str, float]]] = {
    "alpha": [], "a1": [("l1", 1.0)], "a2": [("l2", 1.0)], "a3": [("l3", 1.0)], "a4": [("l4", 1.0), ("l1", 0.5)],
}  # fmt: skip


@pytest.fixture(scope="module")
def group_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base (``alpha.gguf``, chat template and fill-in-the-middle tokens), five adapters for
    it and four adapter-models in ``models.toml``."""
    store = tmp_path_factory.mktemp("adapters")
    write_tiny_model(store / "alpha.gguf", fim=True)
    for i in range(1, 6):
        write_lora(store / f"l{i}.gguf", store / "alpha.gguf", seed=i)
    (store / "models.toml").write_text(TOML)
    return store


@pytest.fixture
def store(group_store: Path, tmp_path: Path) -> Path:
    """A store of its own for a test that changes it: the group's files (hard links), and a model
    of another file (``other``) to swap the group out."""
    folder = tmp_path / "store"
    folder.mkdir()
    for f in group_store.glob("*.gguf"):
        (folder / f.name).hardlink_to(f)
    (folder / "models.toml").write_text(TOML)
    write_tiny_model(folder / "other.gguf", seed=9)
    return folder


def _alone_args(store: Path, model: str) -> list[str]:
    applied = APPLIED[model]
    if not applied:
        return ALONE
    return [*ALONE, "--lora-scaled", ",".join(f"{store / f'{name}.gguf'}:{scale}" for name, scale in applied)]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def alone(group_store: Path) -> Iterator[dict[str, dict[str, str]]]:
    """Each model's answers from llama-server run alone with only its adapters: a raw prompt,
    a chat, a fill-in-the-middle."""
    answers: dict[str, dict[str, str]] = {}
    for model in APPLIED:
        with running_llama_server(group_store / "alpha.gguf", _alone_args(group_store, model)) as server:
            answers[model] = {
                "prompt": _post(f"{server.url}/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0})["content"],
                "chat": _post(f"{server.url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": N, "temperature": 0})["choices"][0]["message"]["content"],
                "infill": _post(f"{server.url}/infill", {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": N, "temperature": 0})["content"],
            }  # fmt: skip
    for kind in ("prompt", "chat", "infill"):  # each adapter set changes every kind of answer
        assert len({a[kind] for a in answers.values()}) == len(APPLIED), kind
    yield answers


async def _generate(client: httpx.AsyncClient, model: str) -> str:
    r = await client.post("/api/generate", json={"model": model, "prompt": PROMPT, "raw": True, "stream": False,
                                                   "options": {"num_predict": N, "temperature": 0}})  # fmt: skip
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


async def test_four_adapter_models_and_their_base_are_one_load_each_answering_as_llama_server_alone(
    group_store: Path, alone: dict[str, dict[str, str]]
) -> None:
    """25 requests rotating over the base and four adapter-models, the same prompt each time (a
    prefix computed under one adapter would show if reused under the next): one runner loaded
    once, every answer llama-server's alone with only that model's adapters; then all five at
    once (four slots), the same."""
    names = list(APPLIED)
    with trio.fail_after(120):
        async with open_test_server(group_store, num_parallel=4, context_length=256, speculation="off") as server, \
                httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:  # fmt: skip
            for i in range(25):
                model = names[i % len(names)]
                assert await _generate(client, model) == alone[model]["prompt"], (i, model)
            got: dict[str, list[str]] = {m: [] for m in names}

            async def ask(model: str) -> None:
                got[model].append(await _generate(client, model))

            for _ in range(2):
                async with trio.open_nursery() as nursery:
                    for model in names:
                        nursery.start_soon(ask, model)
            assert got == {m: [alone[m]["prompt"]] * 2 for m in names}
            metrics = (await client.get("/metrics")).text
            assert "trioshed_loads_total 1.0" in metrics
            stats = server.scheduler.statistics()
            assert stats.loads == 1 and len(stats.runners) == 1
            assert [Path(a).name for a in stats.runners[0].adapters] == ["l1.gguf", "l2.gguf", "l3.gguf", "l4.gguf"]
            ps = (await client.get("/api/ps")).json()["models"]
            assert sorted(m["name"] for m in ps) == sorted(f"{m}:latest" for m in names)
            assert [m["size"] > 0 for m in ps].count(True) == 1  # the runner's size, once
            gateway = next(line for line in metrics.splitlines() if line.startswith("trioshed:lora_requests_info{"))
            assert all(m in gateway for m in names)


async def test_a_prefix_computed_under_one_adapter_is_never_reused_under_another(
    group_store: Path, alone: dict[str, dict[str, str]]
) -> None:
    """One slot: the prompt under a1, another prompt under a2 (the first goes to llama-server's
    host-memory prompt cache), the first prompt again under a2: computed under a2, not taken
    from the cache a1 filled (measured: with that cache on, 60 of 61 tokens came from it and
    the answer changed)."""
    with trio.fail_after(60):
        async with open_test_server(group_store, num_parallel=1, context_length=256, speculation="off") as server, \
                httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:  # fmt: skip
            assert await _generate(client, "a1") == alone["a1"]["prompt"]
            r = await client.post("/api/generate", json={"model": "a2", "prompt": "Something else entirely, to fill the slot",
                                                          "raw": True, "stream": False, "options": {"num_predict": N, "temperature": 0}})  # fmt: skip
            assert r.status_code == 200
            assert await _generate(client, "a2") == alone["a2"]["prompt"]
            assert await _generate(client, "a1") == alone["a1"]["prompt"]
            assert server.scheduler.statistics().runners[0].options.cache_ram_mib == 0


async def test_every_protocol_applies_the_adapter_model_s_adapters(group_store: Path, alone: dict[str, dict[str, str]]) -> None:
    """Ollama's generate and chat, OpenAI's chat, completions and responses, Anthropic's
    messages and /infill: each answers a2 and a4 (two adapters at their scales) as llama-server
    alone with only those adapters, all on the group's one runner."""
    with trio.fail_after(120):
        async with open_test_server(group_store, context_length=256, speculation="off") as server, \
                httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:  # fmt: skip
            for model in ("a2", "a4", "alpha"):
                want = alone[model]
                assert await _generate(client, model) == want["prompt"]
                r = await client.post("/api/chat", json={"model": model, "messages": MESSAGES, "stream": False,
                                                         "options": {"num_predict": N, "temperature": 0}})  # fmt: skip
                assert r.json()["message"]["content"] == want["chat"], ("ollama chat", model)
                r = await client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": N, "temperature": 0})
                assert r.json()["choices"][0]["message"]["content"] == want["chat"], ("openai chat", model)
                r = await client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0})
                assert r.json()["choices"][0]["text"] == want["prompt"], ("openai completions", model)
                r = await client.post("/v1/responses", json={"model": model, "input": MESSAGES[0]["content"], "max_output_tokens": N, "temperature": 0})
                assert r.json()["output"][0]["content"][0]["text"] == want["chat"], ("openai responses", model)
                r = await client.post("/v1/messages", json={"model": model, "messages": MESSAGES, "max_tokens": N, "temperature": 0})
                assert r.json()["content"][0]["text"] == want["chat"], ("anthropic messages", model)
                r = await client.post("/infill", json={"model": model, "input_prefix": "def f(", "input_suffix": "):\n", "n_predict": N, "temperature": 0})
                assert r.json()["content"] == want["infill"], ("infill", model)
                # streamed too: the chat through OpenAI's route
                text = ""
                async with client.stream("POST", "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": N,
                                                                               "temperature": 0, "stream": True}) as s:  # fmt: skip
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                assert text == want["chat"], ("openai chat stream", model)
            # llama-server's own /v1/messages would apply every adapter: refused, not answered wrongly
            r = await client.post("/upstream/a2/v1/messages", json={"messages": MESSAGES, "max_tokens": N})
            assert r.status_code == 400 and "cannot select" in r.text
            assert server.scheduler.statistics().loads == 1


async def test_a_fifth_adapter_model_asked_while_four_are_busy_grows_the_group_and_loses_nothing(
    store: Path, alone: dict[str, dict[str, str]]
) -> None:
    """Four long answers stream from the group's runner; a fifth adapter-model is added to
    models.toml and asked: a runner with five adapters loads beside, the four finish whole on
    the old one, a5 answers as llama-server alone with its adapter, requests asked meanwhile are
    all answered, and the old runner stops."""
    with running_llama_server(store / "alpha.gguf", [*ALONE, "--lora", str(store / "l5.gguf")]) as server:
        want_a5 = _post(f"{server.url}/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0})["content"]
    long = 400
    with trio.fail_after(180):
        async with open_test_server(store, num_parallel=4, context_length=512, speculation="off") as server, \
                httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:  # fmt: skip
            streamed: dict[str, int] = {}
            started = trio.Event()
            answers: dict[str, str] = {}

            async def stream(model: str) -> None:
                body = {"model": model, "prompt": PROMPT, "raw": True, "options": {"num_predict": long, "temperature": 0}}
                async with client.stream("POST", "/api/generate", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        chunk = json.loads(line)
                        assert "error" not in chunk, chunk
                        if chunk.get("done"):
                            streamed[model] = chunk["eval_count"]
                        elif len(streamed) == 0 and not started.is_set():
                            started.set()

            async def ask(model: str) -> None:
                answers[model] = await _generate(client, model)

            async with trio.open_nursery() as nursery:
                for i in range(1, 5):
                    nursery.start_soon(stream, f"a{i}")
                await started.wait()
                toml = trio.Path(store / "models.toml")
                await toml.write_text(await toml.read_text() + '\n[models.a5]\npath = "alpha.gguf"\nadapters = ["l5.gguf"]\n')
                nursery.start_soon(ask, "a5")
                await trio.sleep(0.2)
                for model in ("a1", "a2", "alpha"):
                    nursery.start_soon(ask, model)
            assert streamed == {f"a{i}": long for i in range(1, 5)}  # nothing cut short
            assert answers["a5"] == want_a5
            assert all(answers[m] == alone[m]["prompt"] for m in ("a1", "a2", "alpha"))
            stats = await server.scheduler.wait_statistics(lambda s: len(s.runners) == 1)
            assert stats.loads == 2 and [Path(a).name for a in stats.runners[0].adapters][-1] == "l5.gguf"
            assert any(e.kind == "evict" and "group grew" in e.reason for e in server.scheduler.events.after())


HISTORY = "The river runs to the sea and the sea runs to the sky. " * 8


async def _complete(client: httpx.AsyncClient, model: str, prompt: str) -> tuple[str, int]:
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_saved_slot_is_restored_only_under_the_adapters_that_computed_it(store: Path, tmp_path: Path) -> None:
    """Warm returns on an adapter group's runner: a1's conversation, saved when the group is
    swapped out, is restored for a1 (prefix reused, the answer as computed from scratch) and
    never for a2 asking the same text (computed under a2 from scratch)."""
    with trio.fail_after(120):
        async with open_test_server(store, speculation="off") as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            first, _ = await _complete(client, "a1", HISTORY)
            follow_up = HISTORY + first + " And then the rain came back. "
            cold = {m: (await _complete(client, m, follow_up))[0] for m in ("a1", "a2")}
        assert cold["a1"] != cold["a2"]
        settings = {"kv_cache_dir": tmp_path / "kv", "kv_cache_budget": 64 * 2**20, "max_loaded_models": 1, "speculation": "off"}
        async with open_test_server(store, **settings) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            assert (await _complete(client, "a1", HISTORY))[0] == first
            await _complete(client, "other", "something else entirely, long enough to be kept " * 2)  # the group is swapped out
            assert server.state.warm is not None and server.state.warm.statistics().saves == 1
            resumed, cached = await _complete(client, "a1", follow_up)  # restored under a1's adapters
            assert resumed == cold["a1"] and cached >= len(HISTORY)
            assert server.state.warm.statistics().restores == 1
            await _complete(client, "other", "something else entirely, long enough to be kept " * 2)  # (restores its own)
            before = server.state.warm.statistics()
            other, cached = await _complete(client, "a2", follow_up)  # a1's slot is never restored for a2
            assert other == cold["a2"] and cached == 0
            stats = server.state.warm.statistics()
            assert (stats.restores, stats.hits, stats.restore_failures) == (before.restores, before.hits, 0)


async def test_a_created_model_with_two_adapters_applies_both_and_joins_its_base_s_group(store: Path) -> None:
    """``/api/create`` from the folder's ``alpha`` with two ``ADAPTER``s (uploaded blobs): its
    answer is llama-server's alone with both adapters (``--lora a,b``, one flag), and its base
    is the folder's file by identity (the created blob is a hard link), so it shares the
    group's one runner with ``alpha`` and ``a1``."""
    with running_llama_server(store / "alpha.gguf", [*ALONE, "--lora", f"{store / 'l2.gguf'},{store / 'l3.gguf'}"]) as alone:
        want = _post(f"{alone.url}/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0})["content"]
    with trio.fail_after(60):
        async with open_test_server(store, speculation="off") as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            adapters = {}
            for name in ("l2.gguf", "l3.gguf"):
                data = await trio.Path(store / name).read_bytes()
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                assert (await client.post(f"/api/blobs/{digest}", content=data)).status_code == 201
                adapters[name] = digest
            made = await client.post("/api/create", json={"model": "both", "from": "alpha", "adapters": adapters, "stream": False})
            assert made.status_code == 200, made.text
            assert await _generate(client, "both") == want
            await _generate(client, "alpha")
            await _generate(client, "a1")
            stats = server.scheduler.statistics()
            assert stats.loads == 1 and len(stats.runners[0].adapters) == 6  # the four of models.toml and the two blobs
