"""End to end with the tiny audio projector (``trioshed.testing.vision``): OpenAI's
``input_audio`` parts, Ollama's audio sent as ``images`` and ``/v1/audio/transcriptions`` (with
the official ``openai`` SDK) answer what llama-server alone answers with the runner's own command
line; a model that cannot hear gets each protocol's capability error."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.e2e.test_llama_tools_e2e import _runner_argv
from trioshed.api.protocols.transcription import Transcription
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import tiny_wav, write_tiny_audio_projector

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

WAV = tiny_wav(1.0)
B64 = base64.b64encode(WAV).decode()
N = 5
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}


@pytest.fixture
def audio_store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    write_tiny_model(store / "hear" / "hear.gguf")  # llama.cpp's router layout: a folder per model
    write_tiny_audio_projector(store / "hear" / "mmproj-hear.gguf")
    write_tiny_model(store / "deaf.gguf")
    return store


async def test_audio_reaches_a_model_that_hears(audio_store: Path) -> None:
    chat = {"model": "hear", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, AUDIO_PART]}],
            "temperature": 0, "max_tokens": N}  # fmt: skip
    ollama_chat = {"model": "hear", "stream": False, "options": {"temperature": 0, "num_predict": N},
                   "messages": [{"role": "user", "content": "hi", "images": [B64]}]}  # fmt: skip
    with trio.fail_after(180):
        async with open_test_server(audio_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            show = (await http.post("/api/show", json={"model": "hear"})).json()
            assert "audio" in show["capabilities"] and "vision" not in show["capabilities"]
            assert show["projector_info"]["clip.has_audio_encoder"] is True
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            ours_chat = (r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["message"]["content"])
            o = (await http.post("/api/chat", json=ollama_chat)).json()
            ours_ollama = (o["prompt_eval_count"], o["message"]["content"])

            def sdk_calls() -> tuple[str, str, Any]:
                client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
                plain = client.audio.transcriptions.create(model="hear", file=("a.wav", WAV, "audio/wav"))
                text = client.audio.transcriptions.create(model="hear", file=("a.wav", WAV, "audio/wav"), response_format="text",
                                                          language="en", prompt="a tone")  # fmt: skip
                verbose = client.audio.transcriptions.create(model="hear", file=("a.wav", WAV, "audio/wav"), response_format="verbose_json")
                return plain.text, text, verbose

            plain, text, verbose = await trio.to_thread.run_sync(sdk_calls)
            argv = _runner_argv()
    assert plain and isinstance(text, str) and verbose.text == plain and verbose.duration == pytest.approx(1.0)
    reference = Transcription("hear", WAV, "wav")
    with_context = Transcription("hear", WAV, "wav", language="en", prompt="a tone", response_format="text")

    def alone() -> tuple[tuple[int, str], tuple[int, str], str, str]:
        with running_llama_server(audio_store / "hear" / "hear.gguf", argv) as llama:
            def post(body: dict[str, Any]) -> dict[str, Any]:
                r = httpx.post(f"{llama.url}/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()  # type: ignore[no-any-return]
            c = post({k: v for k, v in chat.items() if k != "model"})
            o = post({"messages": [{"role": "user", "content": [AUDIO_PART, {"type": "text", "text": "hi"}]}], "temperature": 0, "max_tokens": N})
            t1 = post(reference.chat_body())["choices"][0]["message"]["content"].strip()
            t2 = post(with_context.chat_body())["choices"][0]["message"]["content"].strip()
            return ((c["usage"]["prompt_tokens"], c["choices"][0]["message"]["content"]),
                    (o["usage"]["prompt_tokens"], o["choices"][0]["message"]["content"]), t1, t2)  # fmt: skip

    their_chat, their_ollama, their_plain, their_text = await trio.to_thread.run_sync(alone)
    assert ours_chat == their_chat
    assert ours_ollama == their_ollama
    assert (plain, text) == (their_plain, their_text)


async def test_a_model_that_cannot_hear_gets_each_protocols_error(audio_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(audio_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={"model": "deaf", "messages": [{"role": "user", "content": [AUDIO_PART]}]})
            assert r.status_code == 400 and r.json()["error"]["message"] == '"deaf" does not support audio'
            r = await http.post("/api/chat", json={"model": "deaf", "messages": [{"role": "user", "content": "hi", "images": [B64]}]})
            assert r.status_code == 400 and r.json()["error"] == '"deaf" does not support audio'
            files = {"file": ("a.wav", WAV, "audio/wav")}
            r = await http.post("/v1/audio/transcriptions", data={"model": "deaf"}, files=files)
            assert r.status_code == 400 and r.json()["error"]["message"] == '"deaf" does not support audio'
            for data, upload, status in (
                ({}, files, 400),  # no model
                ({"model": "hear"}, None, 400),  # no file
                ({"model": "hear"}, {"file": ("a.txt", b"not audio", "text/plain")}, 400),
                ({"model": "hear", "response_format": "srt"}, files, 400),
                ({"model": "nope"}, files, 404),
            ):
                r = await http.post("/v1/audio/transcriptions", data=data, files=upload or {"other": ("x", b"x")})
                assert r.status_code == status, r.text
                assert "message" in r.json()["error"]
            r = await http.post("/v1/audio/transcriptions", json={"model": "hear"})
            assert r.status_code == 415
            assert (await http.get("/api/ps")).json()["models"] == []  # nothing was loaded for a refusal
        del server
