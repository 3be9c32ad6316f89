"""Capabilities as Ollama checks them, on every generating route of every protocol: a request
that needs what the model cannot do (tools, thinking, images, fill-in-the-middle, or generating
with an embedding-only model) is a 400 with Ollama's words, in the route's error shape, before any
runner is started; ``/api/show``'s ``capabilities`` is the single source."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.api.protocols.anthropic import messages_needs
from trioshed.api.protocols.ollama import needs
from trioshed.api.protocols.openai_chat import chat_needs
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import CHATML_TEMPLATE, write_tiny_model

pytestmark = pytest.mark.usefixtures("no_leaked_runner")

TOOLS_TEMPLATE = "{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}" + CHATML_TEMPLATE
THINKING_TEMPLATE = "{% if enable_thinking %}<think>{% endif %}" + CHATML_TEMPLATE
IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
USER = [{"role": "user", "content": "hi"}]


def test_needs_of_ollama_requests() -> None:
    assert needs("chat", {"messages": USER}) == set()
    assert needs("chat", {"messages": USER, "tools": [{"type": "function"}], "think": True}) == {"tools", "thinking"}
    assert needs("chat", {"messages": [{"role": "user", "content": "x", "images": [IMAGE]}], "think": "high"}) == {"vision", "thinking"}
    assert needs("chat", {"messages": USER, "tools": [], "think": False}) == set()
    assert needs("generate", {"prompt": "x", "suffix": "y", "images": [IMAGE], "think": "none"}) == {"insert", "vision"}


def test_needs_of_anthropic_messages() -> None:
    image = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "source": {}}]}
    assert messages_needs({"messages": USER}) == set()
    assert messages_needs({"messages": [image], "tools": [{"name": "f"}], "thinking": {"type": "enabled"}}) == {"vision", "tools"}
    assert messages_needs({"messages": USER, "tools": []}) == set()


def test_needs_of_openai_chat() -> None:
    image = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:"}}]}
    assert chat_needs({"messages": USER}) == set()
    assert chat_needs({"messages": [image], "tools": [{}], "reasoning_effort": "low"}) == {"vision", "tools", "thinking"}
    assert chat_needs({"messages": USER, "reasoning_effort": "none"}) == set()


#: (route, body, message): every refusal a tiny ChatML model (completion only) or an embedding
#: model gives.
REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("/api/chat", {"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, '"tiny" does not support tools'),
    ("/api/chat", {"model": "tiny", "messages": USER, "think": True}, '"tiny" does not support thinking'),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": [IMAGE]}]}, '"tiny" does not support vision'),
    ("/api/generate", {"model": "tiny", "prompt": "x", "think": "high"}, '"tiny" does not support thinking'),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": [IMAGE]}, '"tiny" does not support vision'),
    ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, '"tiny" does not support insert'),
    ("/api/generate", {"model": "embedder", "prompt": "x"}, '"embedder" does not support generate'),
    ("/api/generate", {"model": "embedder"}, '"embedder" does not support generate'),  # a load too, as Ollama
    ("/api/chat", {"model": "embedder", "messages": USER}, '"embedder" does not support chat'),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, '"tiny" does not support tools'),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "reasoning_effort": "high"}, '"tiny" does not support thinking'),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}]}]}, '"tiny" does not support vision'),
    ("/v1/chat/completions", {"model": "embedder", "messages": USER}, '"embedder" does not support chat'),
    ("/v1/completions", {"model": "embedder", "prompt": "x"}, '"embedder" does not support generate'),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, '"tiny" does not support tools'),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}}]}]}, '"tiny" does not support vision'),
    ("/v1/messages", {"model": "embedder", "max_tokens": 4, "messages": USER}, '"embedder" does not support chat'),
]  # fmt: skip


async def test_refusals_in_each_protocols_shape_and_no_runner_started(model_store: Path) -> None:
    add_tiny(model_store, "embedder", pooling_type=1)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            for route, body, message in REFUSALS:
                r = await http.post(route, json=body)
                assert r.status_code == 400, (route, body, r.text)
                error = r.json()["error"]
                if route == "/v1/messages":
                    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
                elif route.startswith("/v1/"):
                    assert error == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
                else:
                    assert error == message, (route, body)
            assert server.scheduler.statistics().runners == ()
            shown = {m: (await http.post("/api/show", json={"model": m})).json()["capabilities"] for m in ("tiny", "embedder")}
            assert shown == {"tiny": ["completion"], "embedder": ["embedding"]}


@pytest.mark.slow
async def test_what_the_model_can_do_is_served(model_store: Path) -> None:
    """A model whose template takes tools gets them (to the runner and back: 200); /api/show says
    so; a thinking template is reported as thinking; think false is never refused."""
    add_tiny(model_store, "toolsy", chat_template=TOOLS_TEMPLATE)
    add_tiny(model_store, "thinker", chat_template=THINKING_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            shown = {m: (await http.post("/api/show", json={"model": m})).json()["capabilities"] for m in ("toolsy", "thinker")}
            assert shown == {"toolsy": ["completion", "tools"], "thinker": ["completion", "thinking"]}
            opts = {"num_predict": 2, "temperature": 0}
            r = await http.post("/api/chat", json={"model": "toolsy", "messages": USER, "tools": tools, "stream": False, "options": opts})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json={"model": "toolsy", "messages": USER, "tools": tools, "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await http.post("/api/chat", json={"model": "toolsy", "messages": USER, "think": False, "stream": False, "options": opts})
            assert r.status_code == 200, r.text
            assert server.scheduler.statistics().leased == 0


def test_a_models_capabilities_are_worked_out_once_per_version_of_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read per request, they are worked out once per header read (a file version) and per
    projector version: a changed projector file, or a new header, is looked at again."""
    from trioshed.api.pipeline import preamble
    from trioshed.core.model import ModelSpec
    from trioshed.models.gguf_meta import read_metadata

    write_tiny_model(tmp_path / "m.gguf")
    projector = tmp_path / "mmproj-m.gguf"
    projector.write_bytes(b"not yet a projector")
    calls: list[bool] = []
    real = preamble.capabilities

    def counted(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(kwargs["projector"])
        return real(*args, **kwargs)

    monkeypatch.setattr(preamble, "capabilities", counted)
    spec = ModelSpec(name="m:latest", path=str(tmp_path / "m.gguf"), projector=str(projector))
    meta = read_metadata(spec.path)
    first = preamble.capabilities_of(spec, meta)
    assert preamble.capabilities_of(spec, meta) == first and len(calls) == 1
    first.append("mutated")  # a caller's copy
    assert "mutated" not in preamble.capabilities_of(spec, meta) and len(calls) == 1
    projector.write_bytes(b"a different projector file")
    preamble.capabilities_of(spec, meta)
    assert len(calls) == 2
    preamble.capabilities_of(spec, dataclasses.replace(meta))  # another read of the header: a new file version
    assert len(calls) == 3
