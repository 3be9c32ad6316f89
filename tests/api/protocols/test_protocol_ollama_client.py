"""The official ``ollama`` client against the Ollama protocol module, in memory."""

from __future__ import annotations

import json
from typing import Any

from tests.api.protocols.recorded_llama import (
    SAMPLES,
    feed_all,
)
from trioshed.api.protocols.ollama import (
    Kind,
    chat_upstream,
    generate_upstream,
)
from trioshed.api.protocols.ollama_stream import OllamaStream

# --------------------------------------------------------------------------------------------
# the official ollama client, end to end in memory (httpx.MockTransport: no sockets)
# --------------------------------------------------------------------------------------------


def ollama_client_with(sample: str, seen: list[dict[str, Any]]) -> Any:
    """An ``ollama.Client`` whose server is this module: request -> Upstream -> recorded stream."""
    import httpx
    import ollama

    def handle(request: httpx.Request) -> httpx.Response:
        req = json.loads(request.content)
        kind: Kind = "chat" if request.url.path == "/api/chat" else "generate"
        up = chat_upstream(req) if kind == "chat" else generate_upstream(req)
        seen.append({"path": up.path, "body": up.body})
        stream = OllamaStream(kind, req["model"], prefill=up.prefill)
        chunks = feed_all(stream, SAMPLES[sample])
        if req.get("stream", True) is False:
            return httpx.Response(
                200, json=stream.aggregate(load_duration_ns=1, total_duration_ns=2)
            )
        chunks.append(stream.finish(load_duration_ns=1, total_duration_ns=2))
        body = b"".join(json.dumps(c).encode() + b"\n" for c in chunks)
        return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})

    return ollama.Client(host="http://trioshed.test", transport=httpx.MockTransport(handle))


def test_official_client_generate_stream() -> None:
    seen: list[dict[str, Any]] = []
    client = ollama_client_with("completion_stream_len", seen)
    parts = list(
        client.generate(
            model="gemma3",
            prompt="The capital of France is",
            raw=True,
            stream=True,
            options={"num_predict": 5, "temperature": 0, "num_ctx": 2048},
        )
    )
    assert "".join(p.response for p in parts) == " the capital of the country"
    assert parts[-1].done and parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 5
    assert seen == [
        {
            "path": "/completion",
            "body": {
                "stream": True,
                "cache_prompt": True,
                "n_predict": 5,
                "temperature": 0.0,
                "prompt": "The capital of France is",
            },
        }
    ]


def test_official_client_chat_not_streamed_with_tools_and_options() -> None:
    import ollama

    seen: list[dict[str, Any]] = []
    client = ollama_client_with("chat_schema", seen)

    def get_weather(city: str) -> str:
        """Weather in a city.

        Args:
          city: the city
        """
        return "18 C"

    response = client.chat(
        model="gemma3",
        messages=[
            {"role": "user", "content": "Weather?"},
            ollama.Message(
                role="assistant",
                tool_calls=[
                    ollama.Message.ToolCall(
                        function=ollama.Message.ToolCall.Function(
                            name="get_weather", arguments={"city": "Paris"}
                        )
                    )
                ],
            ),
            {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
        ],
        tools=[get_weather],
        format={"type": "object", "properties": {"name": {"type": "string"}}},
        options=ollama.Options(temperature=0, stop=["}"]),
        think=False,
    )
    assert json.loads(response.message.content or "") == {"name": "Assistant Manager"}
    assert response.done_reason == "stop"
    assert response.prompt_eval_count == 27
    body = seen[0]["body"]
    assert body["messages"][1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert (body["temperature"], body["stop"]) == (0.0, ["}"])
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


