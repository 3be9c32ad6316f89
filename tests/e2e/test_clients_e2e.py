"""End to end with the official clients: an Ollama store, the management routes, OpenAI errors.

Real llama-server children (tiny models), real clock with ``fail_after`` guards; the synchronous
``ollama``/``openai`` clients run in worker threads while trioshed serves on the test's loop.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import trio

from tests.models.test_ollama_store import snapshot
from trioshed.testing.ollama_store import add_ollama_model
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.fixture
def ollama_models(tmp_path: Path, tiny_model: Path) -> Path:
    """An Ollama store as ``ollama pull`` leaves it: llama3.2:1b (with params, template, system)
    and someone/helper:q8."""
    root = tmp_path / "ollama-models"
    add_ollama_model(root, "llama3.2:1b", tiny_model, params={"num_predict": 6, "stop": ["<|eot_id|>"]},
                     template="{{ if .Tools }}{{ .Tools }}{{ end }}{{ .Prompt }}", system="You are terse.",
                     config={"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
                             "model_type": "1.2B", "file_type": "Q8_0"})  # fmt: skip
    add_ollama_model(root, "someone/helper:q8", tiny_model)
    return root


async def test_ollama_store_with_the_official_client(ollama_models: Path) -> None:
    before = snapshot(ollama_models)
    with trio.fail_after(120):
        async with open_test_server(ollama_models) as server:
            client = ollama.Client(host=server.base_url)
            listed = await in_thread(client.list)
            assert [m.model for m in listed.models] == ["llama3.2:1b", "someone/helper:q8"]
            first = listed.models[0]
            manifest = ollama_models / "manifests/registry.ollama.ai/library/llama3.2/1b"
            assert first.digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
            assert first.details is not None
            assert (first.details.family, first.details.parameter_size, first.details.quantization_level) == ("llama", "1.2B", "Q8_0")

            shown = await in_thread(client.show, "library/llama3.2:1b")
            assert shown.capabilities == ["completion", "tools"]
            assert shown.template is not None and shown.template.startswith("{{ if .Tools }}")
            assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
            assert shown.details is not None and shown.details.family == "llama"
            assert shown.parameters is not None and "num_predict" in shown.parameters and '"<|eot_id|>"' in shown.parameters

            result = await in_thread(client.generate, model="llama3.2:1b", prompt="hello", stream=False)
            assert result.done and result.eval_count == 6  # the params layer's num_predict applies

            ps = await in_thread(client.ps)
            assert [m.model for m in ps.models] == ["llama3.2:1b"]
            assert ps.models[0].digest == first.digest

            chat = await in_thread(client.chat, model="registry.ollama.ai/someone/helper:q8",
                                   messages=[{"role": "user", "content": "hi"}], options=FAST)  # fmt: skip
            assert chat.done and chat.model == "someone/helper:q8"

            with pytest.raises(ollama.ResponseError) as info:
                await in_thread(client.delete, "llama3.2:1b")
            assert info.value.status_code == 403 and "read" in info.value.error
    assert snapshot(ollama_models) == before  # nothing written into the Ollama store


async def test_management_routes_with_the_official_client(model_store: Path, ollama_models: Path) -> None:
    models = f"{model_store}{os.pathsep}{ollama_models}"
    with trio.fail_after(120):
        async with open_test_server(models) as server:  # type: ignore[arg-type]
            client = ollama.Client(host=server.base_url)
            await in_thread(client.generate, model="tiny", prompt="hi", options=FAST)
            assert [m.model for m in (await in_thread(client.ps)).models] == ["tiny:latest"]

            # copy: an alias in models.toml, of a folder model and of an Ollama-store model
            assert (await in_thread(client.copy, "tiny", "tiny-alias")).status == "success"
            assert (await in_thread(client.copy, "llama3.2:1b", "llama-local:v1")).status == "success"
            names = {m.model for m in (await in_thread(client.list)).models}
            assert {"tiny-alias:latest", "llama-local:v1", "tiny:latest", "llama3.2:1b"} <= names
            aliased = await in_thread(client.generate, model="tiny-alias", prompt="hi", options=FAST)
            assert aliased.done
            assert 'path = "tiny.gguf"' in (model_store / "models.toml").read_text()

            # delete: the alias first (its entry), then the GGUF itself, unloaded before removal
            with pytest.raises(ollama.ResponseError) as info:
                await in_thread(client.delete, "tiny")
            assert info.value.status_code == 409 and "tiny-alias" in info.value.error
            assert (await in_thread(client.delete, "tiny-alias")).status == "success"
            assert [m.model for m in (await in_thread(client.ps)).models] == ["tiny:latest"]  # "tiny" still serves it
            assert (await in_thread(client.delete, "tiny")).status == "success"
            assert not (model_store / "tiny.gguf").exists()
            assert [m.model for m in (await in_thread(client.ps)).models] == []
            with pytest.raises(ollama.ResponseError) as info:
                await in_thread(client.delete, "tiny")
            assert info.value.status_code == 404

            # the routes that write the store: a push of a name that is not here is 404; a blob
            # upload lands (HEAD finds it); a blob announced above the bound is 413 at once, unread
            with pytest.raises(ollama.ResponseError) as info:
                await in_thread(client.push, "me/m")
            assert info.value.status_code == 404
            digest = await in_thread(client.create_blob, model_store / "models.toml")
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                assert (await http.head(f"/api/blobs/{digest}")).status_code == 200
            host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
            sock = await trio.open_tcp_stream(host, int(port))
            async with sock:
                await sock.send_all(b"POST /api/blobs/sha256:" + b"1" * 64 + b" HTTP/1.1\r\nHost: localhost\r\n"
                                    b"Content-Length: 3000000000000\r\n\r\nGGUF")  # fmt: skip
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await sock.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()
            assert (await in_thread(client.list)) is not None  # the client's next request still works


async def test_openai_client_errors_and_models_retrieve(model_store: Path, tmp_path: Path) -> None:
    write_tiny_model(model_store / "embedder.gguf", pooling_type=1)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            model = await in_thread(client.models.retrieve, "tiny")
            assert (model.id, model.object) == ("tiny", "model")
            with pytest.raises(openai.NotFoundError) as info:
                await in_thread(client.models.retrieve, "nope")
            assert "model 'nope' not found" in str(info.value)
            with pytest.raises(openai.NotFoundError) as info2:
                await in_thread(client.chat.completions.create, model="nope", messages=[{"role": "user", "content": "x"}])
            assert info2.value.body == {"message": "model 'nope' not found", "type": "not_found_error", "param": None, "code": "model_not_found"}
            with pytest.raises(openai.BadRequestError) as info3:
                await in_thread(client.chat.completions.create, model="tiny", messages=[], extra_body={"keep_alive": "soon"})
            assert "invalid keep_alive" in str(info3.value) and info3.value.body["type"] == "invalid_request_error"  # type: ignore[index]

            async with httpx.AsyncClient(base_url=server.base_url) as http:
                # Ollama's routes keep Ollama's error shape
                r = await http.post("/api/show", json={"model": "nope"})
                assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
                shown = (await http.post("/api/show", json={"model": "embedder"})).json()
                assert shown["capabilities"] == ["embedding"]
                assert (await http.post("/api/show", json={"model": "tiny"})).json()["capabilities"] == ["completion"]
