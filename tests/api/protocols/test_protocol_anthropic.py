"""Anthropic's Messages API without I/O (trioshed.api.protocols.anthropic, .anthropic_stream).

Requests are checked field by field; answers are llama-server streams as a real b10068 sends them
(recorded below: chat chunks with ``return_progress``, tool-call deltas, ``/completion`` events),
and every event and message is validated against the official ``anthropic`` SDK's types and
accumulated by the SDK's own stream accumulator, which must arrive at :meth:`MessageStream.message`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from trioshed.api.protocols.anthropic import count_tokens_upstream, messages_upstream
from trioshed.api.protocols.anthropic_stream import Event, MessageStream, encode_events, error_event
from trioshed.api.protocols.errors import anthropic_error
from trioshed.api.protocols.transcript import TURN_STOP
from trioshed.errors import BadRequest, UpstreamError

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


def chat_chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
    return {"choices": choices, "created": 1796306210, "id": "chatcmpl-x", "model": "tiny.gguf", "object": "chat.completion.chunk", **extra}


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"usage": {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip


#: A text answer, as llama-server b10068 streams it with return_progress and include_usage.
TEXT = [
    chat_chunk({"role": "assistant", "content": None}, prompt_progress={"total": 60, "cache": 59, "processed": 59, "time_ms": 0}),
    chat_chunk({"role": "assistant", "content": None}, prompt_progress={"total": 60, "cache": 59, "processed": 60, "time_ms": 0}),
    chat_chunk({"role": "assistant", "content": None}),
    chat_chunk({"content": "Hel"}),
    chat_chunk({"content": "lo"}),
    chat_chunk({}, "stop"),
    chat_chunk(None, **usage(60, 3, cached=59)),
]

#: A tool call: the name and id first, then the arguments in pieces; finish_reason tool_calls.
TOOL = [
    chat_chunk({"role": "assistant", "content": None}, prompt_progress={"total": 120, "cache": 0, "processed": 120, "time_ms": 4}),
    chat_chunk({"content": "Let me look."}),
    chat_chunk({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chat_chunk({}, "tool_calls"),
    chat_chunk(None, **usage(120, 9)),
]

#: Reasoning, then the answer (a thinking model's template, parsed by llama-server).
THINKING = [
    chat_chunk({"role": "assistant", "content": None}, prompt_progress={"total": 30, "cache": 0, "processed": 30, "time_ms": 1}),
    chat_chunk({"reasoning_content": "Two and two "}),
    chat_chunk({"reasoning_content": "make four."}),
    chat_chunk({"content": "4"}),
    chat_chunk({}, "stop"),
    chat_chunk(None, **usage(30, 8)),
]

#: /completion (the transcript path) ending on a client's stop string, as recorded from gemma3-270m.
COMPLETION_WORD = [
    {"index": 0, "content": "", "tokens": [0], "stop": False, "tokens_predicted": 0, "tokens_evaluated": 28,
     "prompt_progress": {"total": 28, "cache": 0, "processed": 0, "time_ms": 0}},
    {"index": 0, "content": " 4", "tokens": [236812], "stop": False, "tokens_predicted": 2, "tokens_evaluated": 28},
    {"index": 0, "content": ",", "tokens": [236764], "stop": False, "tokens_predicted": 3, "tokens_evaluated": 28},
    {"index": 0, "content": " 5,", "tokens": [236810], "stop": False, "tokens_predicted": 5, "tokens_evaluated": 28},
    {"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": 8, "tokens_evaluated": 28, "stop_type": "word",
     "stopping_word": " 6", "timings": {"cache_n": 0, "prompt_n": 28, "predicted_n": 8}},
]  # fmt: skip


def run(stream: MessageStream, events: list[dict[str, Any]]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        if stream.cut:
            break
        out += stream.feed(event)
    return out + stream.finish()


def check_with_sdk(events: list[Event], message: dict[str, Any]) -> Any:
    """Each event is one of the SDK's event types; the SDK's accumulator arrives at ``message``
    (the SDK skips ``ping`` events before it parses them)."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for name, data in events:
        assert name == data["type"]
        if name == "ping":
            assert data == {"type": "ping"}
            continue
        parsed = EVENTS.validate_python(data)
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=bufs)
    Message.model_validate(message)
    assert snapshot is not None
    assert snapshot.to_dict(exclude_none=True) == Message.model_validate(message).to_dict(exclude_none=True)
    return snapshot


def names(events: list[Event]) -> list[str]:
    return [name for name, _ in events]


# -- requests -----------------------------------------------------------------------------------


def test_a_plain_request_goes_to_chat_with_the_model_template() -> None:
    req = {**BASE, "system": "Be brief.", "temperature": 0.5, "top_p": 0.9, "top_k": 20, "metadata": {"user_id": "u"}}
    up = messages_upstream(req)
    assert up.upstream.path == "/v1/chat/completions"
    body = up.upstream.body
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (16, 0.5, 0.9, 20)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["return_progress"] is True
    assert "metadata" not in body and "tools" not in body and "stop" not in body
    assert up.stream is False and up.stop_sequences == ()


def test_system_blocks_and_content_blocks() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/\n4AAQ"}}
    req = {**BASE, "system": [{"type": "text", "text": "One.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Two."}],
           "messages": [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
                        {"role": "user", "content": [image, {"type": "text", "text": "And this?"}]}]}  # fmt: skip
    messages = messages_upstream(req).upstream.body["messages"]
    assert messages == [
        {"role": "system", "content": "One.\n\nTwo."},
        {"role": "user", "content": "What is this?"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
                                     {"type": "text", "text": "And this?"}]},
    ]  # fmt: skip


def test_claude_codes_billing_line_is_left_out_of_the_system_prompt() -> None:
    """It changes every request (cch=...): kept, llama-server's prompt cache would miss from the top."""
    billing = "x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch=3f9a1;"
    req = {**BASE, "system": [{"type": "text", "text": billing}, {"type": "text", "text": "You are Claude Code."}]}
    assert messages_upstream(req).upstream.body["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert messages_upstream({**BASE, "system": billing}).upstream.body["messages"] == [{"role": "user", "content": "hi"}]


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages() -> None:
    req = {**BASE, "tools": [WEATHER], "tool_choice": {"type": "auto"}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                                     {"type": "text", "text": "Thanks; and now?"}]},
    ]}  # fmt: skip
    body = messages_upstream(req).upstream.body
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},  # the answer to the calls comes first
        {"role": "user", "content": "Thanks; and now?"},
    ]  # fmt: skip
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                               "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    assert body["tool_choice"] == "auto"


def test_a_tool_result_alone_and_with_a_string() -> None:
    req = {**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42", "is_error": True}]}]}
    assert messages_upstream(req).upstream.body["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "42"}]


@pytest.mark.parametrize(
    ("choice", "expected", "offered"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}, ["get_weather", "other"]),
        ({"type": "any"}, {"tool_choice": "required"}, ["get_weather", "other"]),
        ({"type": "none"}, {"tool_choice": "none"}, ["get_weather", "other"]),
        ({"type": "tool", "name": "other"}, {"tool_choice": "required"}, ["other"]),
        ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}, ["get_weather", "other"]),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: dict[str, Any], offered: list[str]) -> None:
    body = messages_upstream({**BASE, "tools": [WEATHER, {**WEATHER, "name": "other"}], "tool_choice": choice}).upstream.body
    assert {k: body[k] for k in expected} == expected
    assert [t["function"]["name"] for t in body["tools"]] == offered


def test_stop_sequences_are_matched_by_trioshed_on_the_chat_path() -> None:
    up = messages_upstream({**BASE, "stop_sequences": ["END", ""], "stream": True})
    assert "stop" not in up.upstream.body and up.stop_sequences == ("END",) and up.stream is True


def test_thinking_only_when_the_model_can() -> None:
    req = {**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert "chat_template_kwargs" not in messages_upstream(req).upstream.body
    body = messages_upstream(req, thinking_capable=True).upstream.body
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["thinking_budget_tokens"] == 1024
    body = messages_upstream({**BASE, "thinking": {"type": "disabled"}}, thinking_capable=True).upstream.body
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


def test_a_prefill_is_continued_and_its_echo_stripped() -> None:
    req = {**BASE, "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]}
    up = messages_upstream(req)
    assert up.prefill == "1, 2,"
    stream = MessageStream("m", message_id="msg_1", prefill=up.prefill)
    events = run(stream, [chat_chunk({"content": "1, 2, "}), chat_chunk({"content": "3"}), chat_chunk({}, "stop")])
    assert stream.message()["content"] == [{"type": "text", "text": " 3"}]
    check_with_sdk(events, stream.message())


def test_a_model_without_template_gets_the_transcript_on_completion() -> None:
    req = {**BASE, "system": "Be brief.", "stop_sequences": ["END"], "tools": [WEATHER], "temperature": 0,
           "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "bye"}]}  # fmt: skip
    up = messages_upstream(req, chat_template=False, thinking_capable=True)
    assert up.upstream.path == "/completion" and up.turn_stop == TURN_STOP and up.stop_sequences == ()
    body = up.upstream.body
    assert body["prompt"] == "Be brief.\n\nUser: hi\nAssistant: Hello\nUser: bye\nAssistant:"
    assert body["stop"] == ["END", TURN_STOP] and body["n_predict"] == 16 and body["temperature"] == 0.0
    assert "tools" not in body and "messages" not in body
    prefilled = messages_upstream({**BASE, "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1,"}]}, chat_template=False)
    assert prefilled.upstream.body["prompt"] == "User: Count\nAssistant: 1,"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": "8"}, "max_tokens: Input should be a valid integer"),
        ({"messages": None}, "messages: Field required"),
        ({"messages": []}, "messages: at least one message"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages: at least one message"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "image"}]}]}, "messages.1.content.0.type: the system prompt holds text blocks"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type: unsupported content block type \"document\""),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text: Input should be a valid string"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}, "only base64 images"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]}, "belongs in a message with role 'assistant'"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "x"}]}]}, "messages.0.content.0.input: Input should be a valid dictionary"),
        ({"system": [{"type": "image"}]}, "system.0.type"),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema: Input should be a valid dictionary"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool \"web_search_20250305\" is not available"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name: no tool named \"nope\""),
        ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"temperature": "hot"}, "temperature: Input should be a valid number"),
        ({"top_k": 1.5}, "top_k: Input should be a valid integer"),
        ({"stop_sequences": "END"}, "stop_sequences: Input should be a valid list"),
        ({"stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(change: dict[str, Any], message: str) -> None:
    req = {**BASE, **change}
    with pytest.raises(BadRequest) as info:
        messages_upstream({k: v for k, v in req.items() if v is not None}, thinking_capable=True)
    assert message in info.value.message


def test_system_messages_among_the_messages_join_the_system_prompt() -> None:
    # Claude Code puts its environment in a role "system" message after the user's first turn
    req = {**BASE, "system": [{"type": "text", "text": "You are Claude Code."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment"}, {"type": "text", "text": "cwd: /w"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "bye"},
    ]}  # fmt: skip
    assert messages_upstream(req).upstream.body["messages"] == [
        {"role": "system", "content": "You are Claude Code.\n\n# Environment\n\ncwd: /w\n\nBe brief."},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "bye"},
    ]  # fmt: skip
    assert count_tokens_upstream(req).template["messages"][0]["content"].endswith("Be brief.")  # type: ignore[index]
    alone = {**BASE, "system": None, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    assert messages_upstream(alone).upstream.body["messages"][0] == {"role": "system", "content": "S"}
    assert messages_upstream(alone, chat_template=False).upstream.body["prompt"] == "S\n\nUser: hi\nAssistant:"


def test_count_tokens_renders_what_messages_would_send() -> None:
    req = {"model": "m", "system": "S", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    count = count_tokens_upstream(req)
    assert count.text is None and count.template is not None
    sent = messages_upstream({**req, "max_tokens": 1}).upstream.body
    assert count.template == {"messages": sent["messages"], "tools": sent["tools"]}
    assert count_tokens_upstream(req, chat_template=False).text == "S\n\nUser: hi\nAssistant:"


# -- answers ------------------------------------------------------------------------------------


def test_a_text_answer_streamed_and_whole() -> None:
    stream = MessageStream("tiny", message_id="msg_1")
    events = run(stream, TEXT)
    assert names(events) == ["message_start", "ping", "ping", "content_block_start", "content_block_delta",
                             "content_block_delta", "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = events[0][1]["message"]
    assert start["id"] == "msg_1" and start["model"] == "tiny" and start["content"] == []
    assert start["usage"] == {"input_tokens": 1, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 59}
    assert events[7][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[7][1]["usage"]["output_tokens"] == 3
    message = stream.message()
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert (message["stop_reason"], message["usage"]["input_tokens"], message["usage"]["output_tokens"]) == ("end_turn", 1, 3)
    check_with_sdk(events, message)


def test_a_tool_call_streamed_and_whole() -> None:
    stream = MessageStream("tiny", message_id="msg_2")
    events = run(stream, TOOL)
    assert names(events) == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                             "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                             "message_delta", "message_stop"]  # fmt: skip
    assert events[5][1] == {"type": "content_block_start", "index": 1,
                            "content_block": {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {}}}  # fmt: skip
    assert [e[1]["delta"]["partial_json"] for e in events[6:8]] == ['{"city": ', '"Paris"}']
    message = stream.message()
    assert message["content"] == [{"type": "text", "text": "Let me look."},
                                  {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {"city": "Paris"}}]  # fmt: skip
    assert message["stop_reason"] == "tool_use" and message["usage"]["input_tokens"] == 120
    snapshot = check_with_sdk(events, message)
    assert snapshot.content[1].input == {"city": "Paris"}


def test_a_tool_call_without_an_id_gets_one() -> None:
    stream = MessageStream("m", tool_id=lambda: "toolu_fixed")
    run(stream, [chat_chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]}), chat_chunk({}, "stop")])
    assert stream.message()["content"] == [{"type": "tool_use", "id": "toolu_fixed", "name": "f", "input": {}}]
    assert stream.message()["stop_reason"] == "tool_use"


def test_tool_arguments_that_are_not_json_are_an_upstream_error() -> None:
    stream = MessageStream("m")
    run(stream, [chat_chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{oops"}}]}), chat_chunk({}, "tool_calls")])
    with pytest.raises(UpstreamError, match="not JSON"):
        stream.message()


def test_thinking_then_text() -> None:
    stream = MessageStream("m", message_id="msg_3")
    events = run(stream, THINKING)
    message = stream.message()
    assert message["content"] == [{"type": "thinking", "thinking": "Two and two make four.", "signature": ""}, {"type": "text", "text": "4"}]
    assert [e[1]["delta"]["type"] for e in events if e[0] == "content_block_delta"] == ["thinking_delta", "thinking_delta", "text_delta"]
    check_with_sdk(events, message)


def test_max_tokens() -> None:
    stream = MessageStream("m")
    events = run(stream, [chat_chunk({"content": "abc"}), chat_chunk({}, "length"), chat_chunk(None, **usage(5, 1))])
    assert stream.message()["stop_reason"] == "max_tokens"
    check_with_sdk(events, stream.message())


@pytest.mark.parametrize(
    ("pieces", "text", "stop"),
    [
        (["Hello ", "wor", "ld END here"], "Hello world ", "END"),
        (["Hello E", "N", "D"], "Hello ", "END"),  # split over three pieces
        (["Hello E", "NOUGH"], None, None),  # a false start is sent once it cannot be a stop
        (["a STOP b END"], "a ", "STOP"),  # the earliest match wins
        (["xEN"], None, None),  # held back at the end, flushed when upstream finishes
    ],
)
def test_stop_sequences_matched_in_the_stream(pieces: list[str], text: str | None, stop: str | None) -> None:
    stream = MessageStream("m", message_id="msg_4", stop_sequences=["END", "STOP"])
    upstream = [chat_chunk({"content": p}) for p in pieces] + [chat_chunk({}, "stop"), chat_chunk(None, **usage(4, len(pieces) + 1))]
    events = run(stream, upstream)
    message = stream.message()
    if stop is None:
        assert message["content"] == [{"type": "text", "text": "".join(pieces)}] and message["stop_reason"] == "end_turn"
        assert not stream.cut and message["usage"]["output_tokens"] == len(pieces) + 1
    else:
        assert message["content"] == [{"type": "text", "text": text}]
        assert (message["stop_reason"], message["stop_sequence"], stream.cut) == ("stop_sequence", stop, True)
        assert message["usage"]["output_tokens"] == len(pieces)  # the pieces read before the cut
    check_with_sdk(events, message)


def test_the_transcript_path_names_the_stop_string() -> None:
    stream = MessageStream("gemma", message_id="msg_5", turn_stop=TURN_STOP)
    events = run(stream, COMPLETION_WORD)
    message = stream.message()
    assert message["content"] == [{"type": "text", "text": " 4, 5,"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", " 6")
    assert message["usage"] == {"input_tokens": 28, "output_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    check_with_sdk(events, message)
    turn = MessageStream("gemma", turn_stop=TURN_STOP)
    run(turn, [{"content": "Hi.", "stop": False}, {"content": "", "stop": True, "stop_type": "word", "stopping_word": TURN_STOP}])
    assert (turn.message()["stop_reason"], turn.message()["stop_sequence"]) == ("end_turn", None)
    limit = MessageStream("gemma", turn_stop=TURN_STOP)
    run(limit, [{"content": "Hi", "stop": False}, {"content": "", "stop": True, "stop_type": "limit"}])
    assert limit.message()["stop_reason"] == "max_tokens"


def test_an_empty_answer_and_an_unfinished_one() -> None:
    stream = MessageStream("m")
    events = run(stream, [chat_chunk({}, "stop")])
    assert names(events) == ["message_start", "message_delta", "message_stop"]
    assert stream.message()["content"] == []
    check_with_sdk(events, stream.message())
    broken = MessageStream("m")
    broken.feed(chat_chunk({"content": "Hel"}))
    assert not broken.finished


def test_an_error_event_raises() -> None:
    stream = MessageStream("m")
    with pytest.raises(UpstreamError, match="boom"):
        stream.feed({"error": {"code": 500, "message": "boom", "type": "server_error"}})


def test_feed_lines_and_sse_encoding() -> None:
    stream = MessageStream("m", message_id="msg_6")
    lines = [b"data: " + json.dumps(e).encode() for e in TEXT] + [b"", b"data: [DONE]"]
    events = stream.feed_lines(lines) + stream.finish()
    raw = encode_events(events)
    assert raw.startswith(b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_6"')
    assert raw.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert raw.count(b"\n\n") == len(events)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"), (404, "not_found_error"),
     (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error")],
)  # fmt: skip
def test_errors_in_anthropic_shape(status: int, kind: str) -> None:
    assert anthropic_error(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert error_event(status, "why") == b"event: error\ndata: " + json.dumps(anthropic_error(status, "why"), separators=(",", ":")).encode() + b"\n\n"
