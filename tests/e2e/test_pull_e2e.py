"""``/api/pull`` and ``trioshed pull`` end to end: stand-ins on loopback, a real server, real runners.

The official ``ollama`` client pulls with ``stream=True`` from the registry stand-in and from the
Hugging Face stand-in (:mod:`trioshed.testing.registry`), and a generate answers right after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from trioshed.testing.registry import open_stand_in, tree_snapshot
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def statuses(progress: list[Any]) -> list[str]:
    return [p.status for p in progress]


@pytest.fixture
def gguf(tiny_model: Path) -> bytes:
    return tiny_model.read_bytes()


async def test_the_ollama_client_pulls_from_both_stand_ins(model_store: Path, gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(120):
        async with open_stand_in() as stand_in:
            stand_in.add_ollama_model("tiny-llama:1b", gguf, template="{{ .Prompt }}", params={"num_predict": 3})
            stand_in.add_hf_repo("someone/Tiny-GGUF", {"Tiny-Q8_0.gguf": gguf, "Tiny-F16.gguf": gguf + b"\0"})
            monkeypatch.setenv("TRIOSHED_OLLAMA_REGISTRY", stand_in.base_url)
            monkeypatch.setenv("TRIOSHED_HF_ENDPOINT", stand_in.base_url)
            async with open_test_server(model_store) as server:
                client = ollama.Client(host=server.base_url)
                before = {m.model for m in (await in_thread(client.list)).models}
                assert before == {"tiny:latest"}

                progress = await in_thread(lambda: list(client.pull("tiny-llama:1b", stream=True)))
                assert statuses(progress)[0] == "pulling manifest"
                assert statuses(progress)[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
                layers = [p for p in progress if p.digest]
                assert layers and all(p.status == f"pulling {p.digest[7:19]}" and p.total and p.completed is not None for p in layers)
                manifest = json.loads(stand_in.manifests[("library", "tiny-llama", "1b")])
                assert {p.digest for p in layers} == {x["digest"] for x in [*manifest["layers"], manifest["config"]]}
                listed = {m.model for m in (await in_thread(client.list)).models}
                assert listed == {"tiny:latest", "tiny-llama:1b"}
                answer = await in_thread(client.generate, model="tiny-llama:1b", prompt="hello")
                assert answer.done and answer.eval_count == 3  # the pulled params layer applies
                shown = await in_thread(client.show, "tiny-llama:1b")
                assert shown.template == "{{ .Prompt }}"

                hf = await in_thread(lambda: list(client.pull("hf.co/someone/Tiny-GGUF:Q8_0", stream=True)))
                assert statuses(hf)[-1] == "success"
                chat = await in_thread(client.chat, model="hf.co/someone/Tiny-GGUF:Q8_0",
                                       messages=[{"role": "user", "content": "hi"}], options=FAST)  # fmt: skip
                assert chat.done and chat.model == "hf.co/someone/Tiny-GGUF:Q8_0"

                # not streamed: the last line; errors with Ollama's shape and their statuses
                assert (await in_thread(client.pull, "tiny-llama:1b")).status == "success"
                for name, status in (("nothere:7b", 404), ("../x", 400), ("hf.co/someone/Tiny-GGUF:Q2_K", 404),
                                     ("hf.co/someone/Nothing-GGUF", 404)):  # fmt: skip
                    with pytest.raises(ollama.ResponseError) as info:
                        await in_thread(lambda n=name: list(client.pull(n, stream=True)))
                    assert info.value.status_code == status, (name, info.value.error)

                # a wrong digest after the stream started: the last line is the error, nothing kept
                stand_in.add_ollama_model("broken", gguf + b"broken")
                stand_in.tamper.add(next(d for d, b in stand_in.blobs.items() if b == gguf + b"broken"))
                pulled = model_store / "pulled"
                kept = tree_snapshot(pulled)
                with pytest.raises(ollama.ResponseError, match="digest mismatch"):
                    await in_thread(lambda: list(client.pull("broken", stream=True)))
                assert tree_snapshot(pulled) == kept
                assert "broken:latest" not in {m.model for m in (await in_thread(client.list)).models}

                # delete: the manifest and the blobs no other pulled model uses
                assert (await in_thread(client.delete, "tiny-llama:1b")).status == "success"
                assert {m.model for m in (await in_thread(client.list)).models} == {"tiny:latest", "hf.co/someone/Tiny-GGUF:Q8_0"}


async def test_trioshed_pull_with_and_without_a_server(model_store: Path, gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(120):
        async with open_stand_in() as stand_in:
            stand_in.add_ollama_model("tiny-llama:1b", gguf)
            stand_in.add_ollama_model("other:2b", gguf)
            monkeypatch.setenv("TRIOSHED_OLLAMA_REGISTRY", stand_in.base_url)  # the server's pulls
            env = {**os.environ, "TRIOSHED_MODELS": str(model_store)}
            async with open_test_server(model_store) as server:
                env["TRIOSHED_HOST"] = server.base_url.removeprefix("http://")
                done = await trio.run_process([sys.executable, "-m", "trioshed", "pull", "tiny-llama:1b"], env=env,
                                              capture_stdout=True, capture_stderr=True, check=False)  # fmt: skip
                err = done.stderr.decode()
                assert done.returncode == 0, err
                assert err.startswith("pulling manifest\n") and err.endswith("verifying sha256 digest\nwriting manifest\nsuccess\n")
                assert "100% ▕" + "█" * 40 + "▏" in err  # a finished bar per layer
                async with httpx.AsyncClient(base_url=server.base_url) as http:
                    names = {m["name"] for m in (await http.get("/api/tags")).json()["models"]}
                    assert "tiny-llama:1b" in names
                    answer = await http.post("/api/generate", json={"model": "tiny-llama:1b", "prompt": "hi", "stream": False, "options": FAST})
                    assert answer.status_code == 200 and answer.json()["done"]
                missing = await trio.run_process([sys.executable, "-m", "trioshed", "pull", "nothere"], env=env,
                                                 capture_stdout=True, capture_stderr=True, check=False)  # fmt: skip
                assert missing.returncode == 1 and "Error: pull model 'nothere:latest'" in missing.stderr.decode()
            # no server: the same pull, done by the command itself
            env["TRIOSHED_HOST"] = "127.0.0.1:9"
            done = await trio.run_process([sys.executable, "-m", "trioshed", "pull", "other:2b"], env=env,
                                          capture_stdout=True, capture_stderr=True, check=False)  # fmt: skip
            assert done.returncode == 0, done.stderr.decode()
            assert "pulling into" in done.stderr.decode() and (model_store / "pulled/manifests/registry.ollama.ai/library/other/2b").is_file()


def test_the_progress_view() -> None:
    from trioshed.cli.progress import PullView

    lines = [{"status": "pulling manifest"},
             {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2000, "completed": 0},
             {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2000, "completed": 1000},
             {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2000, "completed": 2000},
             {"status": "pulling bbbbbbbbbbbb", "digest": "sha256:" + "b" * 64, "total": 10, "completed": 10},
             {"status": "verifying sha256 digest"}, {"status": "success"}]  # fmt: skip
    plain = PullView(tty=False)
    text = "".join(plain.feed(line) for line in lines) + plain.close()
    assert text.splitlines() == [
        "pulling manifest",
        "pulling aaaaaaaaaaaa... 100% ▕" + "█" * 40 + "▏ 2.0 KB",
        "pulling bbbbbbbbbbbb... 100% ▕" + "█" * 40 + "▏ 10 B",
        "verifying sha256 digest",
        "success",
    ]
    tty = PullView(tty=True)
    drawn = "".join(tty.feed(line) for line in lines) + tty.close()
    assert "\r" in drawn and " 50% ▕" + "█" * 20 + " " * 20 + "▏ 1.0 KB/2.0 KB" in drawn
    assert drawn.endswith("verifying sha256 digest\nsuccess\n")


def test_help_lists_pull() -> None:
    out = subprocess.run([sys.executable, "-m", "trioshed", "--help"], capture_output=True, check=True, text=True).stdout
    assert "pull" in out
