"""The tiny multimodal projectors (``trioshed.testing.vision``) load in the pinned llama-server
and answer image and audio requests: what the multimodal tests elsewhere build on."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from trioshed.core.projector import projector_memory
from trioshed.models.gguf_meta import read_metadata
from trioshed.runner.memlog import parse_memory_log
from trioshed.testing.llama import running_llama_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import (
    AUDIO_CHUNK_TOKENS,
    IMAGE_TOKENS,
    tiny_png,
    tiny_wav,
    write_tiny_audio_projector,
    write_tiny_vision_projector,
)

ARGS = ["-t", "1", "--fit", "off", "-ngl", "0", "-np", "1", "-c", "2048"]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    for write in (write_tiny_vision_projector, write_tiny_audio_projector):
        a, b = write(tmp_path / "a.gguf"), write(tmp_path / "b.gguf")
        assert a.read_bytes() == b.read_bytes()
        assert a.stat().st_size < 160_000
        meta = read_metadata(a)
        assert meta.architecture == "clip"
    assert tiny_png() == tiny_png() and tiny_png(seed=1) != tiny_png()
    assert tiny_wav()[:4] == b"RIFF"


def _chat(url: str, part: dict[str, Any]) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    return post(f"{url}/v1/chat/completions", body)


@pytest.mark.slow
def test_llama_server_sees_an_image(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf")
    projector = write_tiny_vision_projector(tmp_path / "mmproj.gguf")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(tiny_png()).decode()}}
    text_only = {"type": "text", "text": ""}
    with running_llama_server(model, [*ARGS, "--mmproj", str(projector)]) as server:
        with_image = _chat(server.url, image)
        without = _chat(server.url, text_only)
        log = server.log_text()
    # the image is IMAGE_TOKENS tokens plus its two text markers
    assert with_image["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"] >= IMAGE_TOKENS
    assert f"total {IMAGE_TOKENS} tokens" in log
    measured = parse_memory_log(log)
    assert measured is not None and measured.projector, log


@pytest.mark.slow
def test_llama_server_hears_audio(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf")
    projector = write_tiny_audio_projector(tmp_path / "mmproj.gguf")
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(tiny_wav()).decode(), "format": "wav"}}
    with running_llama_server(model, [*ARGS, "--mmproj", str(projector)]) as server:
        answer = _chat(server.url, audio)
        log = server.log_text()
    assert answer["usage"]["prompt_tokens"] > AUDIO_CHUNK_TOKENS
    assert f"total {AUDIO_CHUNK_TOKENS} tokens" in log


@pytest.mark.slow
@pytest.mark.parametrize("flash_attention", [True, False], ids=["fa", "no-fa"])
@pytest.mark.parametrize("write", [write_tiny_vision_projector, write_tiny_audio_projector], ids=["vision", "audio"])
def test_the_projector_estimate_covers_what_llama_cpp_reserves(tmp_path: Path, write: Any, flash_attention: bool) -> None:
    """The estimate (weights + compute buffer) is at least llama.cpp's own numbers, and not
    wildly above them."""
    model = write_tiny_model(tmp_path / "m.gguf")
    projector = write(tmp_path / "mmproj.gguf")
    with running_llama_server(model, [*ARGS, "--mmproj", str(projector), "-fa", "on" if flash_attention else "off"]) as server:
        log = server.log_text()
    measured = parse_memory_log(log)
    assert measured is not None
    reported = sum(measured.projector.values()) + sum(measured.projector_compute.values())
    estimated = projector_memory(read_metadata(projector), flash_attention=flash_attention)
    assert reported <= estimated <= 1.3 * reported + 64 * 1024, (estimated, reported)
