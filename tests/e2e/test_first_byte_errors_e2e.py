"""A runner's error known before the first byte of its answer is the protocol's HTTP error, status
and shape, on every streamed route, not a 200 that starts a stream and ends in an error event
(which makes Codex reconnect five times and Claude Code report a stream error).

The error here is real: the tiny model's vocabulary has no token for a byte >= 0x80, so
llama-server refuses "café" (``400 _Map_base::at``) before it answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import TOOLS_TEMPLATE, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

SAY, FINE = "café", "cafe"
#: Each streamed route: its body with text the model cannot spell, and with text it can.
STREAMS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("/api/chat", {"messages": [{"role": "user", "content": SAY}]}, {"messages": [{"role": "user", "content": FINE}], "options": {"num_predict": 4}}),
    ("/api/generate", {"prompt": SAY}, {"prompt": FINE, "options": {"num_predict": 4}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SAY}], "stream": True},
     {"messages": [{"role": "user", "content": FINE}], "stream": True, "max_tokens": 4}),
    ("/v1/completions", {"prompt": SAY, "stream": True}, {"prompt": FINE, "stream": True, "max_tokens": 4}),
    ("/v1/responses", {"input": SAY, "stream": True}, {"input": FINE, "stream": True, "max_output_tokens": 4}),
    ("/v1/messages", {"messages": [{"role": "user", "content": SAY}], "max_tokens": 4, "stream": True},
     {"messages": [{"role": "user", "content": FINE}], "max_tokens": 4, "stream": True}),
]  # fmt: skip


def _shape(path: str, answer: httpx.Response) -> str:
    """The error's message, read the way the protocol's clients read it."""
    data = answer.json()
    if path.startswith("/api/"):
        return str(data["error"])
    if path == "/v1/messages":
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
        return str(data["error"]["message"])
    assert data["error"]["type"] == "invalid_request_error"
    return str(data["error"]["message"])


async def test_a_runner_error_before_the_first_byte_is_the_status(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "t.gguf", chat_template=TOOLS_TEMPLATE)
    with trio.fail_after(120):
        async with open_test_server(tmp_path) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for path, refused, fine in STREAMS:
                async with http.stream("POST", path, json={"model": "t", **refused}) as answer:
                    await answer.aread()
                assert answer.status_code == 400, (path, answer.text)
                assert answer.headers["content-type"].startswith("application/json"), (path, answer.headers)
                assert "_Map_base::at" in _shape(path, answer), (path, answer.text)
                async with http.stream("POST", path, json={"model": "t", **fine}) as served:
                    await served.aread()
                assert served.status_code == 200 and b"_Map_base" not in served.content, (path, served.text)
            # the SDKs raise their own 400 errors at once, without reconnecting
            client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.BadRequestError):
                async with client.messages.stream(model="t", max_tokens=8, messages=[{"role": "user", "content": SAY}]) as stream:
                    await stream.get_final_message()
            await client.close()
            responses = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError):
                async with responses.responses.stream(model="t", input=SAY) as events:
                    await events.get_final_response()
            await responses.close()

