"""Blobs, create, copy and delete end to end: the official ``ollama`` client against a real
server with real runners, and what lands in the store checked byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import psutil
import pytest
import trio

from tests.conftest import session_llama_servers
from trioshed.errors import BadRequest, InsufficientStorage, NotSupported
from trioshed.models import push as push_module
from trioshed.models.blobs import receive_blob
from trioshed.models.create import Creator
from trioshed.models.stores import Stores
from trioshed.testing.registry import open_stand_in, tree_snapshot
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_lora, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def runner_args() -> list[list[str]]:
    out = []
    for proc in session_llama_servers():
        try:
            out.append(proc.cmdline())
        except psutil.Error:
            continue
    return out


def arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def per_slot_contexts(model_path: str) -> set[int]:
    """The context per slot of every runner of ``model_path`` (its command line)."""
    return {int(arg(a, "--ctx-size") or 0) // int(arg(a, "--parallel") or 1) for a in runner_args() if arg(a, "--model") == model_path}


async def show(base_url: str, name: str) -> dict[str, Any]:
    """``/api/show`` as sent (the client's ShowResponse leaves ``system`` out)."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        answer = await http.post("/api/show", json={"model": name})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def manifest_path(root: Path, namespace: str, name: str, tag: str) -> Path:
    return root / "manifests" / "registry.ollama.ai" / namespace / name / tag


def manifest_of(store: Path, name: str, tag: str = "latest") -> dict[str, Any]:
    return json.loads((store / "pulled" / "manifests" / "registry.ollama.ai" / "library" / name / tag).read_bytes())


async def test_blobs_create_show_copy_delete_with_the_ollama_client(model_store: Path, tiny_model: Path, tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "lora.gguf")
    with trio.fail_after(180):
        async with open_test_server(model_store) as server:
            client = ollama.Client(host=server.base_url)
            # blobs: HEAD 404, upload (201), HEAD 200; a mismatch is a 400 and keeps nothing
            digest = "sha256:" + hashlib.sha256(await trio.to_thread.run_sync(tiny_model.read_bytes)).hexdigest()
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                assert (await http.head(f"/api/blobs/{digest}")).status_code == 404
                wrong = await http.post(f"/api/blobs/{digest}", content=b"GGUF not the model")
                assert wrong.status_code == 400 and "digest mismatch" in wrong.json()["error"]
                assert not list((model_store / "pulled" / "blobs").glob("*"))
                assert (await http.head("/api/blobs/sha256:xyz")).status_code == 400
            assert await in_thread(client.create_blob, tiny_model) == digest
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                assert (await http.head(f"/api/blobs/{digest}")).status_code == 200
            lora_digest = await in_thread(client.create_blob, lora)

            # create from files, with a system prompt and parameters
            progress = await in_thread(lambda: list(client.create(
                model="mine", files={"tiny.gguf": digest}, system="You are a pirate. Always answer as a pirate.",
                parameters={"num_ctx": 1024, "stop": ["<|im_end|>"], "temperature": 0.5}, stream=True)))  # fmt: skip
            statuses = [p.status for p in progress]
            assert statuses[-2:] == ["writing manifest", "success"]
            assert f"using existing layer {digest}" in statuses
            assert any(s.startswith("creating new layer sha256:") for s in statuses)
            listed = {m.model for m in (await in_thread(client.list)).models}
            assert {"mine:latest", "tiny:latest"} <= listed
            shown = await show(server.base_url, "mine")
            assert shown["system"] == "You are a pirate. Always answer as a pirate."
            assert "num_ctx" in shown["parameters"] and "1024" in shown["parameters"]
            base = await in_thread(client.generate, model="tiny", prompt="hello", options=FAST)
            mine = await in_thread(client.generate, model="mine", prompt="hello", options=FAST)
            assert mine.prompt_eval_count > base.prompt_eval_count  # the system prompt is part of the prompt
            blob = str(model_store / "pulled" / "blobs" / f"sha256-{digest[7:]}")
            assert per_slot_contexts(blob) == {1024}  # --ctx-size is num_ctx times --parallel

            # from_ an existing model: num_ctx and a system prompt
            assert (await in_thread(client.create, model="tiny-long", from_="tiny", system="Be brief.", parameters={"num_ctx": 512})).status == "success"
            shown = await show(server.base_url, "tiny-long")
            assert shown["system"] == "Be brief." and "512" in shown["parameters"]
            long = await in_thread(client.generate, model="tiny-long", prompt="hello", options=FAST)
            assert long.prompt_eval_count > base.prompt_eval_count
            assert 512 in per_slot_contexts(blob)  # tiny's file, brought into the store: the same blob

            # an adapter variant: --lora on the runner's command line, and a different answer
            assert (await in_thread(client.create, model="mine-lora", from_="mine", adapters={"lora.gguf": lora_digest})).status == "success"
            adapted = await in_thread(client.generate, model="mine-lora", prompt="hello", options=FAST)
            assert adapted.response != mine.response
            loras = [arg(a, "--lora") for a in runner_args()]
            assert str(model_store / "pulled" / "blobs" / f"sha256-{lora_digest[7:]}") in loras

            # show().modelfile fed back to create gives the same manifest
            shown = await show(server.base_url, "mine-lora")
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                again = await http.post("/api/create", json={"model": "mine-again", "modelfile": shown["modelfile"], "stream": False})
                assert again.status_code == 200, again.text
            assert manifest_of(model_store, "mine-again") == manifest_of(model_store, "mine-lora")

            # copy keeps the blobs shared; deleting one name keeps what the other names
            assert (await in_thread(client.copy, "mine", "mine-copy")).status == "success"
            assert manifest_of(model_store, "mine-copy") == manifest_of(model_store, "mine")
            assert (await in_thread(client.delete, "mine")).status == "success"
            blobs = {p.name for p in (model_store / "pulled" / "blobs").glob("sha256-*")}
            for layer in manifest_of(model_store, "mine-copy")["layers"]:
                assert layer["digest"].replace(":", "-") in blobs
            copied = await in_thread(client.generate, model="mine-copy", prompt="hello", options=FAST)
            assert copied.response == mine.response
            for name in ("mine-copy", "mine-lora", "mine-again", "tiny-long"):
                assert (await in_thread(client.delete, name)).status == "success"
            assert {p.name for p in (model_store / "pulled" / "blobs").glob("sha256-*")} <= {f"sha256-{digest[7:]}", f"sha256-{lora_digest[7:]}"}


BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"model": "x", "modelfile": "FROM tiny\nFOO bar\n"}, 400, "line 2"),
    ({"model": "x", "modelfile": "FROM tiny\nPARAMETER num_ctx lots\n"}, 400, "line 2"),
    ({"model": "x", "modelfile": "FROM tiny\nPARAMETER nonsense 1\n"}, 400, "unknown parameter"),
    ({"model": "x", "from": "nothere"}, 404, "not found"),
    ({"model": "x", "from": "tiny", "template": "{{ if .System }}unclosed"}, 400, "template"),
    ({"model": "x", "from": "tiny", "template": "{% for m in messages %}{{ m }}"}, 400, "template"),
    ({"model": "../x", "from": "tiny"}, 400, "invalid model name"),
    ({"model": "x", "from": "./model.gguf"}, 400, "file path"),
    ({"model": "x", "files": {"../m.gguf": "sha256:" + "0" * 64}}, 400, "not a path"),
    ({"model": "x", "files": {"m.gguf": "sha256:" + "0" * 64}}, 400, "upload it first"),
    ({"model": "x"}, 400, "neither 'from' or 'files' was specified"),
    ({"model": "tiny", "from": "tiny", "system": "hidden"}, 409, "folder store"),
    ({"model": "x", "from": "tiny", "parameters": {"num_ctx": "big"}}, 400, "num_ctx"),
    ({"model": "x", "from": "tiny", "quantize": "q4_K_M"}, 501, "does not quantize"),  # tiny is F32
    ({"model": "x", "from": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "message role"),
]


async def test_bad_creates_leave_the_store_untouched(model_store: Path, tiny_model: Path) -> None:
    async with open_test_server(model_store) as server:
        client = ollama.Client(host=server.base_url)
        await in_thread(client.create_blob, tiny_model)
        before = tree_snapshot(model_store)
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            for body, status, words in BAD:
                for stream in (True, False):
                    answer = await http.post("/api/create", json={**body, "stream": stream})
                    assert answer.status_code == status, (body, answer.text)
                    assert words in answer.json()["error"], (body, answer.text)
        assert tree_snapshot(model_store) == before


async def test_push_to_the_stand_in_then_pull_into_an_empty_store(
    model_store: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with trio.fail_after(120):
        async with open_stand_in() as stand_in:
            stand_in.token = "s3cret"  # every /v2/ request needs the token flow
            monkeypatch.setenv("TRIOSHED_OLLAMA_REGISTRY", stand_in.base_url)
            monkeypatch.setenv("TRIOSHED_REGISTRY_TOKEN", "user-credential")
            monkeypatch.setattr(push_module, "PUSH_CHUNK", 40_000)  # several PATCHes for the tiny model
            async with open_test_server(model_store) as server:
                client = ollama.Client(host=server.base_url)
                digest = await in_thread(client.create_blob, tiny_model)
                await in_thread(client.create, model="me/mine:v1", files={"tiny.gguf": digest}, system="Be a pirate.",
                                parameters={"num_ctx": 1024}, license="MIT")  # fmt: skip
                progress = await in_thread(lambda: list(client.push("me/mine:v1", stream=True)))
                statuses = [p.status for p in progress]
                assert statuses[0] == "retrieving manifest" and statuses[-2:] == ["pushing manifest", "success"]
                model_lines = [p for p in progress if p.digest == digest]
                assert [p.completed for p in model_lines][-1] == model_lines[0].total and len(model_lines) > 3
                assert not stand_in.problems
                mine = manifest_path(model_store / "pulled", "me", "mine", "v1").read_bytes()
                assert stand_in.manifests[("me", "mine", "v1")] == mine
                # a second push sends no blob again
                uploads = len([r for r in stand_in.requests if r.method == "POST"])
                assert (await in_thread(client.push, "me/mine:v1")).status == "success"
                assert len([r for r in stand_in.requests if r.method == "POST"]) == uploads
                for name, status in (("nothere/x:1", 404), ("hf.co/a/b", 400), ("../x", 400), ("tiny", 400)):
                    with pytest.raises(ollama.ResponseError) as info:
                        await in_thread(client.push, name)
                    assert info.value.status_code == status, (name, info.value.error)
            async with open_test_server(empty) as server:
                client = ollama.Client(host=server.base_url)
                assert (await in_thread(client.pull, "me/mine:v1")).status == "success"
                assert manifest_path(empty / "pulled", "me", "mine", "v1").read_bytes() == mine
                for layer in json.loads(mine)["layers"]:
                    path = empty / "pulled" / "blobs" / layer["digest"].replace(":", "-")
                    assert hashlib.sha256(path.read_bytes()).hexdigest() == layer["digest"][7:]
                answer = await in_thread(client.generate, model="me/mine:v1", prompt="hello", options=FAST)
                assert answer.done


MODELFILE = '''# a variant, with every instruction
FROM ./weights/tiny.gguf
parameter num_ctx 768
PARAMETER stop "<|im_end|>"
PARAMETER stop </s>
SYSTEM """You are
a pirate."""
ADAPTER ./lora.gguf
MESSAGE user Hello
MESSAGE assistant "Ahoy"
LICENSE """MIT"""
REQUIRES 0.6.0
'''


async def trioshed_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    done = await trio.run_process([sys.executable, "-m", "trioshed", *args], env=env, capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, done.stderr.decode()


async def test_trioshed_create_uploads_the_modelfiles_files(model_store: Path, tiny_model: Path, tmp_path: Path) -> None:
    client_side = tmp_path / "elsewhere"  # the client's files: the server never reads them
    (client_side / "weights").mkdir(parents=True)
    (client_side / "weights" / "tiny.gguf").write_bytes(await trio.to_thread.run_sync(tiny_model.read_bytes))
    write_tiny_lora(client_side / "lora.gguf")
    (client_side / "Modelfile").write_text(MODELFILE)
    (client_side / "Bad").write_text("FROM ./weights/tiny.gguf\nPARAMETER num_ctx many\n")
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            env = {**os.environ, "TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            code, err = await trioshed_cli(env, "create", "cli-made", "-f", str(client_side / "Modelfile"))
            assert code == 0, err
            assert "copying file sha256:" in err and "100%" in err and err.endswith("writing manifest\nsuccess\n")
            shown = await show(server.base_url, "cli-made")
            assert shown["system"] == "You are\na pirate." and shown["license"] == "MIT"
            assert "num_ctx                        768" in shown["parameters"] and shown["parameters"].count("stop") == 2
            manifest = manifest_of(model_store, "cli-made")
            kinds = [x["mediaType"].rsplit(".", 1)[-1] for x in manifest["layers"]]
            assert kinds == ["model", "adapter", "system", "params", "messages", "license"]
            config = json.loads((model_store / "pulled" / "blobs" / manifest["config"]["digest"].replace(":", "-")).read_bytes())
            assert config["requires"] == "0.6.0" and config["model_family"] == "llama"
            answer = await in_thread(ollama.Client(host=server.base_url).generate, model="cli-made", prompt="hi", options=FAST)
            assert answer.done
            # the MESSAGE lines come before a chat's own messages (more prompt than the same chat without them)
            chat = {"messages": [{"role": "user", "content": "hi"}], "options": FAST, "stream": False}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                made = (await http.post("/api/chat", json={**chat, "model": "cli-made"})).json()
                system = [{"role": "system", "content": "You are\na pirate."}, *chat["messages"]]  # type: ignore[misc]
                plain = (await http.post("/api/chat", json={**chat, "messages": system, "model": "tiny"})).json()
            assert made["prompt_eval_count"] >= plain["prompt_eval_count"] + len("Hello") + len("Ahoy")

            # again: nothing is uploaded twice, every layer exists already, the manifest is the same
            code, err = await trioshed_cli(env, "create", "cli-made", "-f", str(client_side / "Modelfile"))
            assert code == 0 and "copying file" not in err and "creating new layer" not in err, err
            assert manifest_of(model_store, "cli-made") == manifest

            # /api/show's Modelfile creates the same model again, through the command too
            (client_side / "Shown").write_text(shown["modelfile"])
            code, err = await trioshed_cli(env, "create", "cli-again", "-f", str(client_side / "Shown"))
            assert code == 0, err
            assert manifest_of(model_store, "cli-again") == manifest

            before = tree_snapshot(model_store)
            code, err = await trioshed_cli(env, "create", "cli-bad", "-f", str(client_side / "Bad"))
            assert code == 1 and "line 2" in err and "num_ctx" in err
            code, err = await trioshed_cli(env, "create", "cli-bad", "-f", str(client_side / "nothere"))
            assert code == 1 and "cannot read" in err
            assert tree_snapshot(model_store) == before

            code, err = await trioshed_cli(env, "cp", "cli-made", "cli-copy")
            assert code == 0, err
            assert manifest_of(model_store, "cli-copy") == manifest


async def test_a_replaced_model_serves_its_running_request_then_the_new_one(model_store: Path, tmp_path: Path) -> None:
    old = write_tiny_model(tmp_path / "old.gguf", seed=3)
    new = write_tiny_model(tmp_path / "new.gguf", seed=4)
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            client = ollama.Client(host=server.base_url)
            old_digest = await in_thread(client.create_blob, old)
            new_digest = await in_thread(client.create_blob, new)
            await in_thread(client.create, model="swap", files={"m.gguf": old_digest}, parameters={"num_ctx": 1024})
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                body = {"model": "swap", "prompt": "hi", "options": {"num_predict": 64, "temperature": 0, "seed": 1}}
                async with http.stream("POST", "/api/generate", json=body) as running:
                    lines = running.aiter_lines()
                    first = json.loads(await lines.__anext__())
                    assert first["done"] is False
                    # replaced while it streams: the old blob goes (no manifest names it), the runner keeps it open
                    await in_thread(client.create, model="swap", files={"m.gguf": new_digest}, parameters={"num_ctx": 2048})
                    assert not (model_store / "pulled" / "blobs" / f"sha256-{old_digest[7:]}").exists()
                    rest = [json.loads(line) async for line in lines if line.strip()]
                assert rest[-1]["done"] is True and rest[-1]["eval_count"] == 64  # served whole by the old runner
            answer = await in_thread(client.generate, model="swap", prompt="hi", options=FAST)
            assert answer.done
            new_path = str(model_store / "pulled" / "blobs" / f"sha256-{new_digest[7:]}")
            assert any(arg(a, "--model") == new_path for a in runner_args())
            shown = await show(server.base_url, "swap")
            assert "2048" in shown["parameters"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (root only: mounting needs CAP_SYS_ADMIN), unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_create_that_fills_the_disk_is_507_and_keeps_nothing(small_tmpfs: Path, tmp_path: Path) -> None:
    store = small_tmpfs / "store"
    other = tmp_path / "other"
    write_tiny_model(other / "big.gguf", n_embd=256, n_layer=2)  # about 2 MiB: more than the tmpfs holds
    (store / "pulled" / "blobs").mkdir(parents=True)
    (store / "pulled" / "manifests").mkdir()
    stores = Stores(f"{store}{os.pathsep}{other}")
    creator = Creator(stores)
    before = tree_snapshot(small_tmpfs)
    prepared = await creator.prepare({"model": "bigger", "from": "big", "system": "hi"})
    with pytest.raises(InsufficientStorage):
        await creator.run(prepared, _ignore)
    assert tree_snapshot(small_tmpfs) == before


async def test_the_store_writing_routes_pass_the_gate(model_store: Path, tiny_model: Path) -> None:
    data = await trio.to_thread.run_sync(tiny_model.read_bytes)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    async with open_test_server(model_store, api_key="sekrit") as server:
        before = tree_snapshot(model_store)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for method, path, body in (("POST", f"/api/blobs/{digest}", data), ("HEAD", f"/api/blobs/{digest}", None),
                                       ("POST", "/api/create", b'{"model": "m", "from": "tiny"}'),
                                       ("POST", "/api/push", b'{"model": "me/m"}'),
                                       ("POST", "/api/copy", b'{"source": "tiny", "destination": "t2"}')):  # fmt: skip
                answer = await http.request(method, path, content=body)
                assert answer.status_code == 401, (method, path)
                # a page elsewhere cannot drive them either, key or not
                answer = await http.request(method, path, content=body, headers={"Origin": "https://evil.example", "Authorization": "Bearer sekrit"})
                assert answer.status_code == 403, (method, path)
            assert tree_snapshot(model_store) == before
            key = {"Authorization": "Bearer sekrit"}
            assert (await http.post(f"/api/blobs/{digest}", content=data, headers=key)).status_code == 201
            made = await http.post("/api/create", json={"model": "m", "files": {"t.gguf": digest}, "stream": False}, headers=key)
            assert made.status_code == 200 and made.json() == {"status": "success"}


async def test_quantize_is_answered_as_ollama_answers_when_it_cannot(tmp_path: Path) -> None:
    store = tmp_path / "store"
    quantized = write_tiny_model(tmp_path / "q8.gguf", weight_type="Q8_0")
    full = write_tiny_model(tmp_path / "f16.gguf", weight_type="F16")
    creator = Creator(Stores(store))
    digests = {}
    for path in (quantized, full):
        data = await trio.to_thread.run_sync(path.read_bytes)
        digests[path.name] = "sha256:" + hashlib.sha256(data).hexdigest()
        await receive_blob(store / "pulled", digests[path.name], _one(data), length=len(data))
    with pytest.raises(BadRequest, match="quantization is only supported for F16 and F32 models"):
        await creator.prepare({"model": "m", "files": {"q8.gguf": digests["q8.gguf"]}, "quantize": "q4_K_M"})
    with pytest.raises(NotSupported, match="llama-quantize"):
        await creator.prepare({"model": "m", "files": {"f16.gguf": digests["f16.gguf"]}, "quantize": "q4_K_M"})


async def _ignore(line: dict[str, Any]) -> None:
    pass


class _one:
    def __init__(self, data: bytes) -> None:
        self.data: bytes | None = data

    def __aiter__(self) -> _one:
        return self

    async def __anext__(self) -> bytes:
        if self.data is None:
            raise StopAsyncIteration
        data, self.data = self.data, None
        return data
