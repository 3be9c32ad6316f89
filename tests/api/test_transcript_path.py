"""The transcript path (chat with a model that has no chat template) as a full citizen: JSON
schemas honoured on every route, ``stream_options.include_usage`` ending with the usage chunk the
``openai`` SDK expects last, as on the template path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
import trio

from trioshed.api.protocols.openai_chat import (
    CompletionAsChat,
    transcript_completion_body,
    with_response_format,
)
from trioshed.errors import BadRequest
from trioshed.testing.server import open_test_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person."}]


def test_response_format_becomes_json_schema() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    assert with_response_format({"prompt": "x", "response_format": fmt}) == {"prompt": "x", "json_schema": SCHEMA}
    assert with_response_format({"response_format": {"type": "json_object"}}) == {"json_schema": {"type": "object"}}
    assert with_response_format({"response_format": {"type": "text"}, "n": 1}) == {"n": 1}
    body = transcript_completion_body({"messages": ASK, "response_format": fmt, "tools": []})
    assert body["json_schema"] == SCHEMA and "response_format" not in body and "tools" not in body
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "p"}}, "json"):
        with pytest.raises(BadRequest):
            with_response_format({"response_format": bad})


def _events(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]


# llama-server b10068's /v1/completions stream (gemma3-270m, max_tokens 1, stream_options
# include_usage): the finish chunk carries usage itself.
COMPLETION_STREAM = [
    b'data: {"choices":[{"text":" I","index":0,"logprobs":null,"finish_reason":null}],"created":1,"id":"cmpl-1","model":"gemma3-270m","system_fingerprint":"b1-571d0d5","object":"text_completion"}',
    b"",
    b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1,"id":"cmpl-1","model":"gemma3-270m","system_fingerprint":"b1-571d0d5","object":"text_completion","usage":{"completion_tokens":1,"prompt_tokens":12,"total_tokens":13},"timings":{"predicted_n":1}}',
    b"",
    b"data: [DONE]",
    b"",
]  # fmt: skip


@pytest.mark.parametrize("include_usage", [True, False])
def test_usage_chunk_comes_last_only_when_asked(include_usage: bool) -> None:
    events = _events(CompletionAsChat("m", include_usage=include_usage).feed_lines(COMPLETION_STREAM))
    assert [e["object"] for e in events] == ["chat.completion.chunk"] * len(events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": " I"}
    assert events[1]["choices"][0]["finish_reason"] == "length" and "usage" not in events[1]
    if include_usage:
        assert events[2]["choices"] == [] and events[2]["usage"]["completion_tokens"] == 1 and len(events) == 3
        assert events[2]["id"] == events[1]["id"] and events[2]["model"] == "m"
    else:
        assert len(events) == 2


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_schemas_and_usage_on_a_template_less_model(gemma_store: Path) -> None:
    with trio.fail_after(240):
        async with open_test_server(gemma_store) as server:
            oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            whole = await in_thread(oai.chat.completions.create, model="gemma3-270m", messages=ASK, temperature=0,
                                    max_tokens=48, response_format=fmt)  # fmt: skip
            person = json.loads(whole.choices[0].message.content or "")
            assert isinstance(person["name"], str) and isinstance(person["age"], int), person
            obj = await in_thread(oai.chat.completions.create, model="gemma3-270m", messages=ASK, temperature=0,
                                  max_tokens=48, response_format={"type": "json_object"})  # fmt: skip
            assert (obj.choices[0].message.content or "").lstrip().startswith("{")
            legacy = await in_thread(oai.completions.create, model="gemma3-270m", prompt="A person:", temperature=0,
                                     max_tokens=48, extra_body={"response_format": fmt})  # fmt: skip
            assert set(json.loads(legacy.choices[0].text)) >= {"name", "age"}

            def streamed() -> list[Any]:
                return list(oai.chat.completions.create(model="gemma3-270m", messages=ASK, temperature=0, max_tokens=5,
                                                        stream=True, stream_options={"include_usage": True}))  # fmt: skip

            chunks = await in_thread(streamed)
            assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
            assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"

            reply = await in_thread(ollama.Client(host=server.base_url).chat, model="gemma3-270m", messages=ASK,
                                    format=SCHEMA, options={"temperature": 0, "num_predict": 48})  # fmt: skip
            assert set(json.loads(reply.message.content or "")) >= {"name", "age"}
