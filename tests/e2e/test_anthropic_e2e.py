"""Anthropic's Messages API end to end with the official ``anthropic`` SDK against a real trioshed.

Real llama-server children (tiny models; Gemma 3 270M where the words matter), real clock with
``fail_after`` guards; the synchronous SDK runs in worker threads while trioshed serves on the
test's loop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import TOOLS_TEMPLATE, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
#: Greedy sampling: the SDK (2.x) no longer offers ``temperature``; the API still takes it.
GREEDY = {"temperature": 0}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.fixture
def store(tmp_path: Path, tiny_model: Path) -> Path:
    """``tiny`` (a chatml template) and ``tools`` (a template with tools, :data:`TOOLS_TEMPLATE`)."""
    folder = tmp_path / "models"
    folder.mkdir()
    os.link(tiny_model, folder / "tiny.gguf")
    write_tiny_model(folder / "tools.gguf", chat_template=TOOLS_TEMPLATE)
    return folder


def client_for(base_url: str, **auth: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, max_retries=0, timeout=60, **(auth or {"api_key": "unused"}))


async def test_create_stream_and_count_tokens(store: Path) -> None:
    question = [{"role": "user", "content": "Say something."}]
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            client = client_for(server.base_url)
            message = await in_thread(client.messages.create, model="tiny", max_tokens=6, extra_body=GREEDY,
                                      system="Be brief.", messages=question)  # fmt: skip
            assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
            assert message.model == "tiny" and message.stop_reason == "max_tokens" and message.stop_sequence is None
            assert [block.type for block in message.content] == ["text"] and message.content[0].text  # type: ignore[union-attr]
            assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0

            def streamed() -> tuple[str, anthropic.types.Message, list[str]]:
                kinds = []
                with client.messages.stream(model="tiny", max_tokens=6, extra_body=GREEDY, system="Be brief.", messages=question) as stream:
                    text = "".join(stream.text_stream)
                    final = stream.get_final_message()
                with client.messages.stream(model="tiny", max_tokens=6, extra_body=GREEDY, system="Be brief.", messages=question) as again:
                    kinds = [event.type for event in again]
                return text, final, kinds

            text, final, kinds = await in_thread(streamed)
            assert text == message.content[0].text  # type: ignore[union-attr]
            assert final.content[0].text == text and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
            assert final.usage.output_tokens == 6
            assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
            assert "content_block_start" in kinds and "content_block_stop" in kinds

            # count_tokens renders what messages would send: the whole prompt the answers read,
            # part of it from llama-server's cache the second time
            counted = await in_thread(client.messages.count_tokens, model="tiny", system="Be brief.", messages=question)
            for answer in (message, final):
                assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
            assert (final.usage.cache_read_input_tokens or 0) > 0
            assert server.scheduler.statistics().loads == 1


async def test_a_stop_sequence_ends_the_answer_and_is_named(store: Path) -> None:
    question = [{"role": "user", "content": "Go on."}]
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            client = client_for(server.base_url)
            free = await in_thread(client.messages.create, model="tiny", max_tokens=24, extra_body=GREEDY, messages=question)
            full = free.content[0].text  # type: ignore[union-attr]
            stop = full[10:13]
            expected = full[: full.index(stop)]
            whole = await in_thread(client.messages.create, model="tiny", max_tokens=24, extra_body=GREEDY, messages=question,
                                    stop_sequences=[stop])  # fmt: skip
            assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
            assert whole.content[0].text == expected  # type: ignore[union-attr]

            def streamed() -> anthropic.types.Message:
                with client.messages.stream(model="tiny", max_tokens=24, extra_body=GREEDY, messages=question, stop_sequences=[stop]) as s:
                    return s.get_final_message()

            final = await in_thread(streamed)
            assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
            assert final.content[0].text == expected  # type: ignore[union-attr]
            with trio.fail_after(10):  # the cut-off generation ended upstream: the runner is free again
                await server.scheduler.wait_statistics(lambda s: s.leased == 0)


async def test_a_tool_round_trip(store: Path) -> None:
    """The model's tool call comes back as a tool_use block with its input parsed; the client
    answers with a tool_result and gets the model's next turn. (A random tiny model never writes
    a call by itself: the call is the assistant's turn continued, which llama-server parses.)"""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            client = client_for(server.base_url)
            called = await in_thread(client.messages.create, model="tools", max_tokens=1, extra_body=GREEDY, tools=[WEATHER],
                                     tool_choice={"type": "auto"}, messages=[ask, {"role": "assistant", "content": CALL}])  # fmt: skip
            uses = [block for block in called.content if block.type == "tool_use"]
            assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"}
            assert uses[0].id

            def streamed_call() -> anthropic.types.Message:
                with client.messages.stream(model="tools", max_tokens=1, extra_body=GREEDY, tools=[WEATHER],
                                            messages=[ask, {"role": "assistant", "content": CALL}]) as s:  # fmt: skip
                    return s.get_final_message()

            streamed = await in_thread(streamed_call)
            assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [("tool_use", {"city": "Paris"})]

            history = [ask, {"role": "assistant", "content": [block.model_dump() for block in called.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 24 C"}]}]  # fmt: skip
            reply = await in_thread(client.messages.create, model="tools", max_tokens=5, extra_body=GREEDY, tools=[WEATHER], messages=history)
            assert reply.stop_reason == "max_tokens" and reply.content[0].type == "text"
            counted = await in_thread(client.messages.count_tokens, model="tools", tools=[WEATHER], messages=history)
            assert counted.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)


async def test_errors_have_anthropics_shape(store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(store, api_key="right") as server:
            client = client_for(server.base_url, auth_token="right")
            with pytest.raises(anthropic.NotFoundError) as missing:
                await in_thread(client.messages.create, model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert missing.value.status_code == 404
            assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
            assert "nope" in missing.value.body["error"]["message"]  # type: ignore[index]
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await in_thread(client_for(server.base_url, auth_token="wrong").messages.create, model="tiny", max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
            # the SDK's api_key (ANTHROPIC_API_KEY) goes as x-api-key: accepted in place of the bearer token
            with pytest.raises(anthropic.AuthenticationError):
                await in_thread(client_for(server.base_url, api_key="wrong").messages.count_tokens, model="tiny",
                                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            keyed = await in_thread(client_for(server.base_url, api_key="right").messages.count_tokens, model="tiny",
                                    messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            assert keyed.input_tokens > 0
            async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": "Bearer right"}) as http:
                r = await http.post("/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 400
                assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
                r = await http.post("/v1/messages/count_tokens", content=b"{")
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert server.scheduler.statistics().loads == 1  # count_tokens' tokenizer; nothing before the key was right


async def test_gemma_through_the_transcript(gemma_store: Path) -> None:
    """The demo model has no chat template: the conversation is a plain transcript, the prefill
    continues it, and the stop sequence that ended the answer is named."""
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}, {"role": "assistant", "content": "1, 2, 3,"}]
    with trio.fail_after(240):
        async with open_test_server(gemma_store) as server:
            client = client_for(server.base_url)
            whole = await in_thread(client.messages.create, model="gemma3-270m", max_tokens=30, extra_body=GREEDY,
                                    messages=messages, stop_sequences=[" 6"])  # fmt: skip
            assert whole.content[0].text == " 4, 5,"  # type: ignore[union-attr]
            assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", " 6")

            def streamed() -> tuple[str, anthropic.types.Message]:
                with client.messages.stream(model="gemma3-270m", max_tokens=30, extra_body=GREEDY, messages=messages, stop_sequences=[" 6"]) as s:
                    return "".join(s.text_stream), s.get_final_message()

            text, final = await in_thread(streamed)
            assert text == " 4, 5," and (final.stop_reason, final.stop_sequence) == ("stop_sequence", " 6")
            question = [{"role": "user", "content": "What is the capital of France?"}]
            answer = await in_thread(client.messages.create, model="gemma3-270m", max_tokens=24, extra_body=GREEDY, messages=question)
            said = answer.content[0].text  # type: ignore[union-attr]
            assert said.strip() and "User:" not in said and "<" not in said, said
            assert answer.stop_reason in ("end_turn", "max_tokens")
            counted = await in_thread(client.messages.count_tokens, model="gemma3-270m", messages=question)
            assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def test_sse_lines_are_named_events() -> None:
    """What the SDK skips without an ``event:`` line would be lost: every event names itself."""
    from trioshed.api.protocols.anthropic_stream import MessageStream, encode_events

    stream = MessageStream("m", message_id="msg_x")
    raw = encode_events(stream.feed({"choices": [{"delta": {"content": "a"}, "finish_reason": "stop", "index": 0}]}) + stream.finish())
    for chunk in raw.decode().split("\n\n")[:-1]:
        event, data = chunk.split("\n")
        assert event.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")
