"""Warm returns end to end: real llama-server children save their slots when swapped out and
restore them when the conversation comes back (``trioshed.runner.slots``).

Two tiny models of the same shape but different weights share one runner place
(``max_loaded_models=1``): asking for one unloads the other. Real clock, ``fail_after`` guards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.core.model import MiB
from trioshed.runner.slots import WarmStats
from trioshed.server import Server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

HISTORY = "The river runs to the sea and the sea runs to the sky. " * 8
OPTIONS = {"max_tokens": 8, "temperature": 0, "seed": 1}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """``a`` and ``b``: one shape, different weights (llama-server would accept a's slot file
    into b without complaint: only trioshed's key keeps them apart)."""
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_model(folder / "a.gguf", seed=1, name="a")
    write_tiny_model(folder / "b.gguf", seed=2, name="b")
    return folder


def warm(server: Server) -> WarmStats:
    assert server.state.warm is not None
    return server.state.warm.statistics()


async def complete(client: httpx.AsyncClient, model: str, prompt: str) -> tuple[str, int]:
    """The answer, and how many prompt tokens llama-server found in its cache."""
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, **OPTIONS})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def generate(client: httpx.AsyncClient, model: str, prompt: str) -> str:
    return (await complete(client, model, prompt))[0]


def settings(kv: Path, **more: Any) -> dict[str, Any]:
    return {"kv_cache_dir": kv, "kv_cache_budget": 64 * MiB, "max_loaded_models": 1, **more}


async def cold_answer(store: Path, model: str, prompt: str) -> str:
    """The same request computed from scratch (warm returns off)."""
    async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        answer, cached = await complete(client, model, prompt)
        assert cached == 0
        return answer


async def test_a_swapped_out_conversation_is_restored_and_answers_as_computed_from_scratch(store: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with trio.fail_after(120):
        async with open_test_server(store, **settings(kv)) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            first = await generate(client, "a", HISTORY)
            await generate(client, "b", "something else entirely, long enough to be kept " * 2)  # a is swapped out
            saved = warm(server)
            assert (saved.saves, saved.files, saved.restores) == (1, 1, 0)
            assert saved.bytes_on_disk == sum(p.stat().st_size for p in kv.glob("*.bin")) > 0
            assert not list(kv.glob("partial-*"))

            follow_up = HISTORY + first + " And then the rain came back. "
            resumed, cached = await complete(client, "a", follow_up)  # b is swapped out, a restored
            assert cached >= len(HISTORY)  # the tiny models' tokens are characters
            after = warm(server)
            assert (after.hits, after.restores, after.restore_failures) == (1, 1, 0)
            assert after.restore_seconds > 0 and after.save_seconds > 0
            assert after.saves == 2  # b's conversation was saved on its way out
            metrics = (await client.get("/metrics")).text
            assert "trioshed_kv_restores_total 1.0" in metrics and "trioshed_kv_bytes " in metrics
        assert await cold_answer(store, "a", follow_up) == resumed


async def test_a_shutdown_saves_every_runners_slot_before_its_child_is_stopped(store: Path, tmp_path: Path) -> None:
    # A shutdown cancels every runner at once; each child must go on answering until its slot is
    # saved. (It was sent SIGTERM at the same moment: the save then waited for the whole
    # TRIOSHED_KV_SAVE_TIMEOUT and was dropped, and every SIGTERM to trioshed took 5 s.)
    kv = tmp_path / "kv"
    with trio.fail_after(60):
        async with open_test_server(store, **settings(kv, max_loaded_models=2)) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                await generate(client, "a", HISTORY)
                await generate(client, "b", "something else entirely, long enough to be kept " * 2)
            assert warm(server).saves == 0  # both still loaded
    stats = warm(server)
    assert (stats.saves, stats.saves_skipped, stats.save_failures) == (2, 0, 0), stats
    assert len(list(kv.glob("*.bin"))) == 2 and not list(kv.glob("partial-*"))


async def test_a_slot_of_another_model_is_never_restored(store: Path, tmp_path: Path) -> None:
    """Same shape, same prompt: b never gets a's slot, nor does a rewritten a.gguf."""
    kv = tmp_path / "kv"
    with trio.fail_after(120):
        async with open_test_server(store, **settings(kv)) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            await generate(client, "a", HISTORY)
            answer_b, cached = await complete(client, "b", HISTORY)  # a saved; b has no file of its own yet
            assert cached == 0
            assert warm(server).saves == 1 and warm(server).restores == 0
            write_tiny_model(store / "a.gguf", seed=3, name="a")  # a replaced by other weights
            answer_new_a, cached = await complete(client, "a", HISTORY)  # b saved; neither file fits
            assert cached == 0
            stats = warm(server)
            assert (stats.restores, stats.hits) == (0, 0)
        assert answer_b == await cold_answer(store, "b", HISTORY)
        assert answer_new_a == await cold_answer(store, "a", HISTORY)


async def test_a_corrupt_saved_slot_is_ignored_and_the_request_served(store: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with trio.fail_after(120):
        async with open_test_server(store, **settings(kv)) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            first = await generate(client, "a", HISTORY)
            await generate(client, "b", "x")  # a saved; b's slot holds too little to be kept
            [saved] = kv.glob("*.bin")
            data = bytearray(saved.read_bytes())
            data[len(data) - 100] ^= 0xFF  # one KV byte: llama-server itself would take it
            saved.write_bytes(bytes(data))
            follow_up = HISTORY + first + " And then?"
            answer, cached = await complete(client, "a", follow_up)
            assert cached == 0
            stats = warm(server)
            assert (stats.restores, stats.restore_failures) == (0, 1)
            assert not saved.exists()  # dropped
        assert answer == await cold_answer(store, "a", follow_up)


async def test_a_slot_larger_than_the_budget_is_not_kept(store: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with trio.fail_after(120):
        async with open_test_server(store, **settings(kv, kv_cache_budget=64 * 1024)) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            await generate(client, "a", HISTORY)
            await generate(client, "b", "x")
            stats = warm(server)
            assert (stats.saves, stats.saves_skipped, stats.files) == (0, 1, 0)
            assert list(kv.iterdir()) == []


async def test_gemma3_a_restored_slot_is_reused_with_swa_full(tmp_path: Path, gemma_model: Path) -> None:
    """Gemma 3 has sliding-window layers: llama-server reuses a restored slot only with
    --swa-full, which warm returns turn on (and /api/ps shows, with the prompt cache's size)."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "gemma3.gguf").symlink_to(gemma_model)
    write_tiny_model(folder / "tiny.gguf", name="tiny")
    history = "Rivers carve valleys and carry sediment to the sea. " * 6
    with trio.fail_after(300):
        async with (
            open_test_server(folder, **settings(tmp_path / "kv", allow_symlinks=True, cache_ram=64 * MiB)) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=120) as client,
        ):
            first = await generate(client, "gemma3", history)
            ps = (await client.get("/api/ps")).json()["models"][0]["runner"]
            assert (ps["cache_ram"], ps["swa_full"]) == (64 * MiB, True)
            await generate(client, "tiny", "x")  # gemma3 saved
            follow_up = history + first + " And lakes?"
            resumed, cached = await complete(client, "gemma3", follow_up)
            assert warm(server).restores == 1 and cached >= 60
        async with open_test_server(folder, allow_symlinks=True) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            cold, cached = await complete(client, "gemma3", follow_up)
            assert cached == 0
    assert resumed == cold


def test_the_slot_endpoints_answer_as_trioshed_expects(tmp_path: Path) -> None:
    """b10068's slot calls and answers, as ``trioshed.runner.slots`` uses them (and the one gap
    trioshed's key closes: a same-shaped model's file is accepted)."""
    import json
    import urllib.error
    import urllib.request

    from trioshed.core.kvcache import slot_file_tokens
    from trioshed.testing.llama import running_llama_server

    def call(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    a, b = write_tiny_model(tmp_path / "a.gguf", seed=1), write_tiny_model(tmp_path / "b.gguf", seed=2)
    wide = write_tiny_model(tmp_path / "wide.gguf", n_embd=128, seed=1)
    kv = tmp_path / "kv"
    kv.mkdir()
    args = ["-c", "512", "-np", "1", "-t", "1", "--fit", "off", "-ngl", "0", "--device", "none", "--slot-save-path", str(kv)]
    with running_llama_server(a, args) as server:
        (fresh,) = call(server.url, "/slots")[1]
        assert "id_task" not in fresh and fresh["is_processing"] is False
        assert call(server.url, "/completion", {"prompt": HISTORY, "n_predict": 4, "temperature": 0})[0] == 200
        (used,) = call(server.url, "/slots")[1]
        assert "id_task" in used and used["n_prompt_tokens"] > 0
        status, saved = call(server.url, "/slots/0?action=save", {"filename": "partial-x.bin"})
        assert status == 200 and saved["n_saved"] > 0 and saved["n_written"] == (kv / "partial-x.bin").stat().st_size
        assert "save_ms" in saved["timings"]
        assert call(server.url, "/slots/0?action=save", {"filename": "../x.bin"})[0] == 400  # a bare name only
        tokens = call(server.url, "/tokenize", {"content": HISTORY, "add_special": True, "parse_special": True})[1]["tokens"]
        assert list(slot_file_tokens((kv / "partial-x.bin").read_bytes()))[: len(tokens)] == tokens
        status, restored = call(server.url, "/slots/0?action=restore", {"filename": "partial-x.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"] and "restore_ms" in restored["timings"]
        status, error = call(server.url, "/slots/0?action=restore", {"filename": "missing.bin"})
        assert status == 400 and "Unable to restore slot" in error["error"]["message"]
    with running_llama_server(b, args) as server:  # same shape, other weights: accepted
        assert call(server.url, "/slots/0?action=restore", {"filename": "partial-x.bin"})[0] == 200
    with running_llama_server(wide, args) as server:  # another shape: refused, and it serves on
        assert call(server.url, "/slots/0?action=restore", {"filename": "partial-x.bin"})[0] == 400
        assert call(server.url, "/completion", {"prompt": "hi", "n_predict": 2})[0] == 200


async def test_a_reload_for_a_larger_context_keeps_the_conversation(store: Path, tmp_path: Path) -> None:
    """A reload for other options unloads (and saves); the new runner's key is the same (the
    context is not in it), and its larger context holds the file: restored."""

    async def ollama(client: httpx.AsyncClient, prompt: str, num_ctx: int) -> str:
        body = {"model": "a", "prompt": prompt, "raw": True, "stream": False,
                "options": {"num_ctx": num_ctx, "num_predict": 8, "temperature": 0, "seed": 1}}  # fmt: skip
        r = await client.post("/api/generate", json=body)
        assert r.status_code == 200, r.text
        answer: str = r.json()["response"]
        return answer

    with trio.fail_after(120):
        async with open_test_server(store, **settings(tmp_path / "kv")) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            first = await ollama(client, HISTORY, 1024)
            follow_up = HISTORY + first + " Then?"
            resumed = await ollama(client, follow_up, 2048)  # reload: saved, then restored
            stats = warm(server)
            assert (stats.saves, stats.restores) == (1, 1)
            assert [r.context_length for r in server.scheduler.statistics().runners] == [2048]
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            assert await ollama(client, follow_up, 2048) == resumed
