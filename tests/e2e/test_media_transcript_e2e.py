"""Images and sounds sent to a model with a projector and no chat template (a base model that
sees or hears): each protocol's request, whole and streamed, answers what llama-server alone
answers for the same transcript prompt given to its multimodal ``/completion`` (the media marker
where each image or sound stood, the bytes beside it): the same prompt tokens (the media's
among them) and the same greedy text. Where it cannot be done, a 400 in the protocol's shape."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from tests.e2e.test_llama_tools_e2e import _runner_argv
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import (
    AUDIO_CHUNK_TOKENS,
    IMAGE_TOKENS,
    tiny_png,
    tiny_wav,
    write_tiny_audio_projector,
    write_tiny_vision_projector,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

PNG = base64.b64encode(tiny_png(seed=3)).decode()
WAV = base64.b64encode(tiny_wav(1.0)).decode()
N = 6  # greedy tokens per answer
M = "<media>"  # where the test's expected transcripts put the runner's marker
STOP = "\nUser:"
IMAGE_URL = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}


@pytest.fixture
def media_store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    write_tiny_model(store / "seer" / "seer.gguf", chat_template="")  # llama.cpp's router layout: a folder per model
    write_tiny_vision_projector(store / "seer" / "mmproj-seer.gguf")
    write_tiny_model(store / "hearer" / "hearer.gguf", chat_template="")
    write_tiny_audio_projector(store / "hearer" / "mmproj-hearer.gguf")
    shutil.copy(store / "seer" / "seer.gguf", store / "blind.gguf")  # the same model, no projector
    return store


#: (name, route, body through trioshed, the transcript llama-server alone gets, its media)
VISION: list[tuple[str, str, dict[str, Any], str, list[str]]] = [
    ("ollama chat", "/api/chat", {"messages": [{"role": "user", "content": "what is it?", "images": [PNG]}]},
     f"User: {M}what is it?\nAssistant:", [PNG]),
    ("ollama generate", "/api/generate", {"prompt": "describe", "images": [PNG]}, f"{M}describe", [PNG]),
    ("openai chat", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Look."}, {"role": "user", "content": [{"type": "text", "text": "hi "}, IMAGE_URL, {"type": "text", "text": " and?"}]}]},
     f"Look.\n\nUser: hi {M} and?\nAssistant:", [PNG]),
    ("openai responses", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": IMAGE_URL["image_url"]["url"]}]}]},
     f"User: see{M}\nAssistant:", [PNG]),
    ("anthropic", "/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}, {"type": "text", "text": "look"}]}]},
     f"User: {M}look\nAssistant:", [PNG]),
]  # fmt: skip

HEARING: list[tuple[str, str, dict[str, Any], str, list[str]]] = [
    ("ollama chat", "/api/chat", {"messages": [{"role": "user", "content": "hi", "images": [WAV]}]}, f"User: {M}hi\nAssistant:", [WAV]),
    ("openai chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, AUDIO]}]},
     f"User: hi{M}\nAssistant:", [WAV]),
]  # fmt: skip


def _body(route: str, body: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    if route.startswith("/api/"):
        return {**body, "model": model, "stream": stream, "options": {"temperature": 0, "num_predict": N}}
    if route == "/v1/responses":
        return {**body, "model": model, "stream": stream, "temperature": 0, "max_output_tokens": N}
    out = {**body, "model": model, "stream": stream, "temperature": 0, "max_tokens": N}
    return out | ({"stream_options": {"include_usage": True}} if stream and route == "/v1/chat/completions" else {})


def _events(text: str) -> list[dict[str, Any]]:
    """The JSON events of an SSE or NDJSON stream."""
    out = []
    for line in text.splitlines():
        line = line.removeprefix("data: ").strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _answer(route: str, r: httpx.Response, stream: bool) -> tuple[int, str]:
    """(prompt tokens, text) of an answer in its protocol's shape, whole or streamed."""
    assert r.status_code == 200, r.text
    if not stream:
        d = r.json()
        if route == "/api/chat":
            return d["prompt_eval_count"], d["message"]["content"]
        if route == "/api/generate":
            return d["prompt_eval_count"], d["response"]
        if route == "/v1/messages":
            return d["usage"]["input_tokens"] + d["usage"].get("cache_read_input_tokens", 0), d["content"][0]["text"]
        if route == "/v1/responses":
            return d["usage"]["input_tokens"], d["output"][0]["content"][0]["text"]
        return d["usage"]["prompt_tokens"], d["choices"][0]["message"]["content"]
    events = _events(r.text)
    if route.startswith("/api/"):
        text = "".join(e["message"]["content"] if route == "/api/chat" else e["response"] for e in events)
        return events[-1]["prompt_eval_count"], text
    if route == "/v1/messages":
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        return start["input_tokens"] + start.get("cache_read_input_tokens", 0), text
    if route == "/v1/responses":
        done = next(e for e in events if e.get("type") in ("response.completed", "response.incomplete"))["response"]
        return done["usage"]["input_tokens"], done["output"][0]["content"][0]["text"]
    text = "".join((c["delta"].get("content") or "") for e in events for c in e.get("choices", []))
    return next(e for e in events if e.get("usage"))["usage"]["prompt_tokens"], text


def _alone(model: Path, argv: list[str], cases: list[tuple[str, str, dict[str, Any], str, list[str]]]) -> list[tuple[int, str]]:
    """llama-server alone, the same command line: each case's transcript on /completion."""
    out = []
    with running_llama_server(model, argv) as llama:
        marker = httpx.get(f"{llama.url}/props", timeout=30).json()["media_marker"]
        for _, _, _, text, media in cases:
            prompt = {"prompt_string": text.replace(M, marker), "multimodal_data": media}
            r = httpx.post(f"{llama.url}/completion", timeout=120,
                           json={"prompt": prompt, "temperature": 0, "n_predict": N, "stop": [STOP]})  # fmt: skip
            assert r.status_code == 200, r.text
            out.append((r.json()["tokens_evaluated"], r.json()["content"]))
    return out


@pytest.mark.parametrize("kind", ["vision", "hearing"])
async def test_media_reach_a_base_model_on_every_protocol(media_store: Path, kind: str) -> None:
    model, cases = ("seer", VISION) if kind == "vision" else ("hearer", HEARING)
    ours: dict[bool, list[tuple[int, str]]] = {}
    with trio.fail_after(300):
        async with open_test_server(media_store, context_length=4096) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            for stream in (False, True):
                ours[stream] = [_answer(route, await http.post(route, json=_body(route, body, model, stream)), stream)
                                for _, route, body, _, _ in cases]  # fmt: skip
            argv = _runner_argv()
    alone = await trio.to_thread.run_sync(_alone, media_store / model / f"{model}.gguf", argv, cases)
    names = [name for name, *_ in cases]
    assert dict(zip(names, ours[False], strict=True)) == dict(zip(names, alone, strict=True))
    assert dict(zip(names, ours[True], strict=True)) == dict(zip(names, alone, strict=True))
    least = IMAGE_TOKENS if kind == "vision" else AUDIO_CHUNK_TOKENS
    assert all(tokens > least for tokens, _ in alone)  # the media are in the prompt, not dropped


async def test_the_official_clients_send_media_to_a_base_model(media_store: Path) -> None:
    """The ``openai`` and ``anthropic`` SDKs, streamed, as a user would send an image."""
    with trio.fail_after(180):
        async with open_test_server(media_store, context_length=4096) as server:

            def calls() -> tuple[int, int]:
                oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
                with oa.chat.completions.create(model="seer", max_tokens=N, temperature=0, stream=True, stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": [IMAGE_URL, {"type": "text", "text": "look"}]}]) as s:  # type: ignore[list-item]  # fmt: skip
                    usage = next(c.usage for c in s if c.usage)
                an = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
                with an.messages.stream(model="seer", max_tokens=N, messages=[{"role": "user", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                        {"type": "text", "text": "look"}]}]) as ms:  # fmt: skip
                    final = ms.get_final_message()
                assert usage is not None
                return usage.prompt_tokens, final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)

            openai_tokens, anthropic_tokens = await trio.to_thread.run_sync(calls)
            blind = await _text_only_tokens(server.base_url)
    assert openai_tokens == anthropic_tokens > blind + IMAGE_TOKENS - 2  # the image's tokens, its markers' few less


async def _text_only_tokens(base_url: str) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json={"model": "seer", "max_tokens": 1, "messages": [{"role": "user", "content": "look"}]})
    return int(r.json()["usage"]["prompt_tokens"])


async def test_media_a_base_model_cannot_take_are_refused_in_each_protocols_shape(media_store: Path) -> None:
    url = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    with trio.fail_after(120):
        async with open_test_server(media_store, context_length=4096) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={"model": "seer", "messages": [{"role": "user", "content": [url]}]})
            assert r.status_code == 400 and "data: URI" in r.json()["error"]["message"], r.text
            r = await http.post("/v1/responses", json={"model": "seer", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "https://example.invalid/cat.png"}]}]})  # fmt: skip
            assert r.status_code == 400 and "data: URI" in r.json()["error"]["message"], r.text
            r = await http.post("/v1/chat/completions", json={"model": "seer", "logprobs": True, "messages": [{"role": "user", "content": [IMAGE_URL]}]})
            assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text
            # what a model cannot take at all is refused as on any model, before a runner starts
            r = await http.post("/api/chat", json={"model": "blind", "messages": [{"role": "user", "content": "hi", "images": [PNG]}]})
            assert r.status_code == 400 and r.json()["error"] == '"blind" does not support vision', r.text
            r = await http.post("/v1/messages", json={"model": "seer", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.invalid/cat.png"}}]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            r = await http.post("/v1/chat/completions", json={"model": "seer", "messages": [{"role": "user", "content": [AUDIO]}]})
            assert r.status_code == 400 and r.json()["error"]["message"] == '"seer" does not support audio', r.text
            assert server.scheduler.statistics().runners == ()
