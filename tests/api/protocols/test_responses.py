"""OpenAI's Responses API (``/v1/responses``): the request as a chat completion, the answer and
its events as the official ``openai`` SDK parses them (pure tests), and the SDK's
``responses.create``, whole and streamed, with a function-call round trip, against a real
trioshed (tiny models; Gemma where the content matters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from trioshed.api.protocols.openai_responses import (
    NOT_STORED,
    Response,
    ResponsesStream,
    chat_request,
    response_of,
)
from trioshed.errors import BadRequest
from trioshed.testing.server import open_test_server

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def test_chat_request_from_text_and_items() -> None:
    assert chat_request({"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9}) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
    }  # fmt: skip
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny in Paris."}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
    ]  # fmt: skip
    chat = chat_request({"input": items, "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
                         "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}, "reasoning": {"effort": "low"}})  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": TOOLS[0]["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert chat["reasoning_effort"] == "low"
    # built-in tools (Codex sends web_search, custom...) are left out: the function tools remain
    assert chat_request({"input": "x", "tools": [{"type": "web_search"}, *TOOLS]})["tools"] == chat["tools"]
    assert "tools" not in chat_request({"input": "x", "tools": [{"type": "web_search"}]})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, NOT_STORED),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference needs stored responses"),
        ({"input": []}, "input must be a string or a non-empty list"),
        ({"input": 5}, "input must be a string"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role must be"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type must be"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "must have call_id, name and arguments"),
        ({"input": "x", "tools": [{"type": "function"}]}, 'must be {"type": "function", "name"'),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 5}]}, "parameters must be a JSON schema object"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be at least 1"),
        ({"input": "x", "temperature": "hot"}, "temperature must be a number"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type must be"),
        ({"input": "x", "instructions": 5}, "instructions must be a string"),
    ],
)
def test_chat_request_refuses(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        chat_request(body)


def _sse(data: bytes) -> list[dict[str, Any]]:
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n", 1)
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
    return events


# llama-server's /v1/chat/completions chunks (the shapes recorded in tests/api/protocols/recorded_llama.py and
# those its to_json_oaicompat_chat_stream writes for reasoning and tool calls)
TEXT_CHUNKS = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"reasoning_content": "Think."}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hello"}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " there"}}]},
    {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}]},
    {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 7, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}},
]  # fmt: skip
CALL_CHUNKS = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}}]},
    {"choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}]},
]  # fmt: skip


def _stream(chunks: list[dict[str, Any]], body: dict[str, Any]) -> list[dict[str, Any]]:
    stream = ResponsesStream(Response(body, "tiny", 1_800_000_000))
    data = stream.start() + b"".join(stream.feed(c) for c in chunks) + stream.finish(1_800_000_001)
    events = _sse(data)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=body.get("tools") or [], text_format=openai.omit)
    for event in events:  # the SDK's own types and its stream accumulator accept every event
        state.handle_event(EVENTS.validate_python(event))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_stream_events_in_the_sdk_order() -> None:
    events = _stream(TEXT_CHUNKS, {"model": "tiny", "input": "hi"})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = SDKResponse.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello there" and final.model == "tiny"
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens, final.usage.input_tokens_details.cached_tokens) == (7, 3, 2)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["id"] == final.id


def test_tool_call_stream_and_length_limit() -> None:
    events = _stream(CALL_CHUNKS, {"model": "tiny", "input": "weather?", "tools": TOOLS})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    call = SDKResponse.model_validate(events[-1]["response"]).output[0]
    assert call.type == "function_call" and (call.call_id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Paris"})
    cut = _stream([{"choices": [{"finish_reason": "length", "index": 0, "delta": {"content": "Hel"}}]}], {"input": "hi", "max_output_tokens": 1})
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"} and cut[-1]["response"]["max_output_tokens"] == 1
    # the item the limit cut is incomplete too (OpenAI's API marks it; Codex reads it)
    done = [e["item"] for e in cut if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in done] == ["incomplete"] and cut[-1]["response"]["output"][0]["status"] == "incomplete"
    assert SDKResponse.model_validate(cut[-1]["response"]).output[0].status == "incomplete"
    # a tool call after text, cut: the text is whole, the call is not
    both = _stream([{"choices": [{"index": 0, "delta": {"content": "Let me look."}}]},
                    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_weather", "arguments": '{"ci'}}]}}]},
                    {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]}], {"input": "hi", "tools": TOOLS})  # fmt: skip
    assert [i["status"] for i in both[-1]["response"]["output"]] == ["completed", "incomplete"]


def test_whole_response_cut_by_its_limit_is_incomplete_with_its_item() -> None:
    answer = {"choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Hel"}}]}
    whole = response_of(Response({"input": "hi", "max_output_tokens": 1}, "tiny", 1), answer, 2)
    assert whole["status"] == "incomplete" and [i["status"] for i in whole["output"]] == ["incomplete"]
    assert SDKResponse.model_validate(whole).output[0].status == "incomplete"
    answer["choices"][0]["finish_reason"] = "stop"  # type: ignore[index]
    assert [i["status"] for i in response_of(Response({"input": "hi"}, "tiny", 1), answer, 2)["output"]] == ["completed"]


def test_whole_response_of_a_chat_completion() -> None:
    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}  # fmt: skip
    out = SDKResponse.model_validate(response_of(Response({"input": "x", "tools": TOOLS}, "tiny", 1), answer, 2))
    assert out.status == "completed" and [o.type for o in out.output] == ["function_call"]
    text = SDKResponse.model_validate(response_of(Response({"input": "x"}, "tiny", 1), {"choices": [{"text": "Hi", "finish_reason": "stop"}]}, 2))
    assert text.output_text == "Hi" and text.store is False


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_openai_sdk_responses_against_trioshed(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            whole = await in_thread(client.responses.create, model="tiny", input="hi", instructions="Be brief.", max_output_tokens=4, temperature=0)
            assert whole.object == "response" and whole.model == "tiny" and whole.status == "incomplete"
            assert whole.output_text and whole.usage is not None and whole.usage.output_tokens == 4

            def streamed() -> list[Any]:
                return list(client.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=4, temperature=0, stream=True))

            events = await in_thread(streamed)
            assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
            assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text

            # the function-call round trip's second half: the call the client got and its output go back as input items
            turn = [{"role": "user", "content": "Weather in Paris?"},
                    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]  # fmt: skip
            answer = await in_thread(client.responses.create, model="tiny", input=turn, max_output_tokens=3, temperature=0)
            assert answer.output[0].type == "message" and answer.usage is not None and answer.usage.input_tokens > 0

            with pytest.raises(openai.BadRequestError) as stored:
                await in_thread(client.responses.create, model="tiny", input="hi", previous_response_id=whole.id)
            assert stored.value.body["message"] == NOT_STORED  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as tools:
                await in_thread(client.responses.create, model="tiny", input="hi", tools=TOOLS)  # type: ignore[arg-type]
            assert tools.value.body["message"] == '"tiny" does not support tools'  # type: ignore[index]
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                assert "/v1/responses" in (await http.get("/openapi.json")).json()["paths"]
            assert server.scheduler.statistics().leased == 0


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_responses_on_gemma_with_a_json_schema(gemma_store: Path) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    with trio.fail_after(240):
        async with open_test_server(gemma_store) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            answer = await in_thread(client.responses.create, model="gemma3-270m", input="What is the capital of France?",
                                     max_output_tokens=24, temperature=0)  # fmt: skip
            assert "Paris" in answer.output_text, answer.output_text
            person = await in_thread(client.responses.create, model="gemma3-270m", input="Describe a person.", max_output_tokens=48,
                                     temperature=0, text={"format": {"type": "json_schema", "name": "person", "schema": schema}})  # fmt: skip
            data = json.loads(person.output_text)
            assert isinstance(data["name"], str) and isinstance(data["age"], int)

            def streamed() -> Any:
                with client.responses.stream(model="gemma3-270m", input="What is the capital of France?", max_output_tokens=24, temperature=0) as s:
                    text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
                    return text, s.get_final_response()

            text, final = await in_thread(streamed)
            assert text == final.output_text == answer.output_text
