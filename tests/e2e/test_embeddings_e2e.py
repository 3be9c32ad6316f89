"""Embeddings through trioshed against the same llama-server run alone (real binary, tiny models).

A 4,096-context CLS-pooled model: inputs of ~600, 2,000 and 4,000 tokens answer 200 on every
embeddings route with llama-server's own vectors (its own pooling, not mean); 6,000 tokens are cut
to the context (Ollama's default ``truncate``) or refused with a 400 in the route's words; a
64-input list comes back in input order; ``dimensions`` and base64 round-trip through the
official ``openai`` and ``ollama`` clients.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

CTX = 4096
SIZES = (600, 2000, 4000)
WORDS = "the quick brown fox jumps over a lazy dog while seven zebras quietly graze "


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _text_of(url: str, n_tokens: int) -> str:
    """A text of exactly ``n_tokens`` tokens (with the model's BOS) for the tiny tokenizer."""
    text = (WORDS * (n_tokens // 10 + 2))[: n_tokens]
    while len(_post(f"{url}/tokenize", {"content": text, "add_special": True})["tokens"]) > n_tokens:
        text = text[:-1]
    return text


@pytest.fixture(scope="module")
def cls_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cls") / "cls.gguf", pooling_type=2, context_length=CTX)


@pytest.fixture(scope="module")
def direct(cls_model: Path) -> dict[str, Any]:
    """What llama-server alone answers on the model with its own options (``-b/-ub`` = context)."""
    args = ["--embeddings", "-c", str(CTX), "-b", str(CTX), "-ub", str(CTX), "--device", "none", "-t", "1", "-np", "1"]
    with running_llama_server(cls_model, args, timeout=60) as server:
        texts = {n: _text_of(server.url, n) for n in SIZES}
        short = ["hello world", *[f"chunk {i}: {WORDS[: 5 + i % 40]}" for i in range(64)]]
        out: dict[str, Any] = {"texts": texts, "short": short}
        out["normalized"] = {n: _post(f"{server.url}/v1/embeddings", {"input": t})["data"][0]["embedding"] for n, t in texts.items()}
        out["raw"] = {n: _post(f"{server.url}/v1/embeddings", {"input": t, "embd_normalize": -1})["data"][0]["embedding"] for n, t in texts.items()}
        answer = _post(f"{server.url}/v1/embeddings", {"input": short})
        out["short_vectors"] = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
        out["long"] = (WORDS * 90)[:6000]
        out["long_tokens"] = len(_post(f"{server.url}/tokenize", {"content": out["long"], "add_special": True})["tokens"])
    return out


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def test_long_inputs_equal_llama_server_alone(tmp_path: Path, cls_model: Path, direct: dict[str, Any]) -> None:
    store = tmp_path / "models"
    store.mkdir()
    (store / "cls.gguf").hardlink_to(cls_model)
    with trio.fail_after(300):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            for n, text in direct["texts"].items():
                r = await http.post("/api/embed", json={"model": "cls", "input": text})
                assert r.status_code == 200, r.text
                assert r.json()["embeddings"][0] == direct["normalized"][n]  # to the float
                assert r.json()["prompt_eval_count"] == n
                r = await http.post("/v1/embeddings", json={"model": "cls", "input": [text]})
                assert r.status_code == 200, r.text
                assert r.json()["data"][0]["embedding"] == direct["normalized"][n]
                r = await http.post("/api/embeddings", json={"model": "cls", "prompt": text})
                assert r.status_code == 200, r.text
                assert _close(r.json()["embedding"], direct["raw"][n])
            # the CLS-pooled vector, not a mean: equal to the direct one for a short input too
            r = await http.post("/api/embed", json={"model": "cls", "input": direct["short"]})
            assert r.json()["embeddings"] == direct["short_vectors"]  # 65 inputs, in input order
            # longer than the context: cut (default), or a 400 naming the tokens and the context
            long = direct["long"]
            assert direct["long_tokens"] > CTX
            r = await http.post("/api/embed", json={"model": "cls", "input": long})
            assert r.status_code == 200, r.text
            assert r.json()["prompt_eval_count"] <= CTX
            r = await http.post("/api/embed", json={"model": "cls", "input": ["hello world", long]})
            assert r.status_code == 200, r.text
            assert r.json()["embeddings"][0] == direct["short_vectors"][0]  # the short one untouched
            assert r.json()["prompt_eval_count"] <= CTX + 13  # "hello world": 13 tokens
            r = await http.post("/api/embeddings", json={"model": "cls", "prompt": long})
            assert r.status_code == 200, r.text
            r = await http.post("/api/embed", json={"model": "cls", "input": long, "truncate": False})
            assert r.status_code == 400
            assert r.json() == {"error": f'input 0 has {direct["long_tokens"]} tokens, more than the context length of {CTX}: shorten it, set "truncate": true, or raise num_ctx'}
            r = await http.post("/v1/embeddings", json={"model": "cls", "input": ["ok", long]})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                f"This model's maximum context length is {CTX} tokens, however you requested "
                f"{direct['long_tokens']} tokens (input 1). Please reduce your input."
            )
            assert "physical batch" not in r.text
            assert server.scheduler.statistics().loads == 1


async def test_truncated_input_keeps_the_special_tokens_and_fills_the_context(tmp_path: Path, cls_model: Path, direct: dict[str, Any]) -> None:
    """The cut input is the first tokens of the text after the model's BOS, exactly ``CTX`` in all:
    its vector is llama-server's for those token ids."""
    store = tmp_path / "models"
    store.mkdir()
    (store / "cls.gguf").hardlink_to(cls_model)
    long = direct["long"]
    with running_llama_server(cls_model, ["--embeddings", "-c", str(CTX), "-b", str(CTX), "-ub", str(CTX), "--device", "none", "-t", "1"]) as alone:
        tokens = _post(f"{alone.url}/tokenize", {"content": long, "add_special": True})["tokens"][:CTX]
        expected = _post(f"{alone.url}/v1/embeddings", {"input": [tokens]})["data"][0]["embedding"]
    with trio.fail_after(120):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            r = await http.post("/api/embed", json={"model": "cls", "input": long})
            assert r.status_code == 200, r.text
            assert r.json()["prompt_eval_count"] == CTX
            assert r.json()["embeddings"][0] == expected


async def test_dimensions_and_base64_through_the_official_clients(tmp_path: Path, cls_model: Path, direct: dict[str, Any]) -> None:
    store = tmp_path / "models"
    store.mkdir()
    (store / "cls.gguf").hardlink_to(cls_model)
    full = direct["short_vectors"][0]
    cut = [x / math.sqrt(sum(y * y for y in full[:16])) for x in full[:16]]
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            # the SDK asks for base64 by default and decodes it itself
            got = await in_thread(oai.embeddings.create, model="cls", input="hello world")
            assert _close(got.data[0].embedding, full, 1e-7)
            got = await in_thread(oai.embeddings.create, model="cls", input="hello world", dimensions=16)
            assert _close(got.data[0].embedding, cut, 1e-6)
            got = await in_thread(oai.embeddings.create, model="cls", input=["hello world"], encoding_format="base64")
            raw = base64.b64decode(got.data[0].embedding)  # type: ignore[arg-type]
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(full, abs=1e-7)
            client = ollama.Client(host=server.base_url)
            result = await in_thread(client.embed, model="cls", input="hello world", dimensions=16)
            assert _close(list(result.embeddings[0]), cut, 1e-6)
            with pytest.raises(openai.BadRequestError, match="more than the model's 64"):
                await in_thread(oai.embeddings.create, model="cls", input="x", dimensions=65)
            r = await trio.to_thread.run_sync(lambda: httpx.post(f"{server.base_url}/api/embed", json={"model": "cls", "input": "x", "truncate": "no"}))
            assert r.status_code == 400 and r.json()["error"].startswith('"truncate" must be true or false')


async def test_a_reranker_does_not_embed_and_an_embedder_does_not_chat(model_store: Path) -> None:
    add_tiny(model_store, "ranker", pooling_type=4)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            r = await http.post("/api/embed", json={"model": "ranker", "input": "x"})
            assert (r.status_code, r.json()) == (400, {"error": '"ranker" does not support embeddings'})
            r = await http.post("/v1/embeddings", json={"model": "ranker", "input": "x"})
            assert r.status_code == 400 and r.json()["error"]["message"] == '"ranker" does not support embeddings'
            r = await http.post("/v1/embeddings", json={"model": "tiny", "input": ["x"] * 2049})
            assert r.status_code == 400 and "at most 2048" in r.json()["error"]["message"]
            assert server.scheduler.statistics().runners == ()


async def test_a_model_trained_on_a_shorter_context_cuts_to_what_its_runner_holds(model_store: Path) -> None:
    """num_ctx 4,096 on a model trained on 512: llama-server holds 512 tokens per slot, and the
    cut follows what it says (its refusal names its context), not the asked context."""
    add_tiny(model_store, "short", pooling_type=1, context_length=512)
    text = WORDS * 12  # ~900 tokens
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/api/embed", json={"model": "short", "input": text})
            assert r.status_code == 200, r.text
            assert 500 <= r.json()["prompt_eval_count"] <= 512
            r = await http.post("/api/embed", json={"model": "short", "input": text, "truncate": False})
            assert r.status_code == 400 and "more than the context length of 512" in r.json()["error"], r.text
