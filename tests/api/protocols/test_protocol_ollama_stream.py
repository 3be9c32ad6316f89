"""llama-server streams as Ollama chunks (trioshed.api.protocols.ollama_stream, .llama), from
streams recorded from a real llama-server (``tests/api/protocols/recorded_llama.py``); every chunk is checked
against the official ``ollama`` client's pydantic types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ollama._types import ChatResponse, GenerateResponse

from tests.api.protocols.recorded_llama import (
    CREATED,
    ERROR_BODIES,
    SAMPLES,
    feed_all,
    final_of,
    fixed_clock,
    run_stream,
    validate,
)
from trioshed.api.protocols.llama import parse_sse_line, upstream_error_message
from trioshed.api.protocols.ollama import (
    chat_upstream,
)
from trioshed.api.protocols.ollama_stream import OllamaStream
from trioshed.api.protocols.openai_chat import openai_model_rewrite
from trioshed.errors import UpstreamError


@pytest.mark.parametrize(
    ("line", "event"),
    [
        ('data: {"a": 1}', {"a": 1}),
        (b'data: {"a": 1}\r\n', {"a": 1}),
        ('data:{"a":1}\n', {"a": 1}),
        ("data: [DONE]", None),
        (b"data: [DONE]\r\n", None),
        ("", None),
        ("\r\n", None),
        (":", None),
        (": ping", None),
        ("event: message", None),
        ('{"content": "x", "stop": false}', {"content": "x", "stop": False}),
        ('error: {"code": 500, "message": "boom"}', {"error": {"code": 500, "message": "boom"}}),
    ],
)
def test_parse_sse_line(line: str | bytes, event: dict[str, Any] | None) -> None:
    assert parse_sse_line(line) == event


@pytest.mark.parametrize("line", ["data: {not json", "data: [1, 2]", 'data: "x"'])
def test_parse_sse_line_malformed(line: str) -> None:
    with pytest.raises(UpstreamError):
        parse_sse_line(line)


def test_openai_model_rewrite() -> None:
    chunk = {"id": "x", "model": "gemma3.gguf", "choices": []}
    assert openai_model_rewrite(chunk, "gemma3:270m") == {
        "id": "x",
        "model": "gemma3:270m",
        "choices": [],
    }
    assert chunk["model"] == "gemma3.gguf"
    assert openai_model_rewrite({"error": {}}, "m") == {"error": {}}


def test_upstream_error_event_raises() -> None:
    stream = OllamaStream("chat", "m", created_at_fn=fixed_clock)
    event = {"error": {"code": 500, "message": "context full", "type": "server_error"}}
    assert upstream_error_message(event) == "context full"
    with pytest.raises(UpstreamError, match="context full"):
        stream.feed(event)



def test_completion_stream_length_limit() -> None:
    stream, chunks = run_stream("completion_stream_len", "generate")
    assert chunks == [
        {"model": "gemma3", "created_at": CREATED, "response": text, "done": False}
        for text in [" the", " capital", " of", " the", " country"]
    ]
    assert stream.finished
    assert final_of(stream) == {
        "model": "gemma3",
        "created_at": CREATED,
        "response": "",
        "done": True,
        "done_reason": "length",
        "total_duration": 1_000_000_000,
        "load_duration": 7,
        "prompt_eval_count": 6,
        "prompt_eval_duration": 130_437_000,
        "eval_count": 5,
        "eval_duration": 183_528_000,
    }


def test_completion_stop_word_skips_held_back_empty_events() -> None:
    stream, chunks = run_stream("completion_stop_word", "generate")
    assert [c["response"] for c in chunks] == [" 5", ",", " 6", ","]
    final = final_of(stream)
    assert final["done_reason"] == "stop"
    assert (final["prompt_eval_count"], final["eval_count"]) == (12, 8)


def test_completion_eos_is_stop() -> None:
    stream, chunks = run_stream("completion_json", "generate")
    assert [c["response"] for c in chunks] == ["{}"]
    assert final_of(stream)["done_reason"] == "stop"


def test_completion_probs_become_logprobs() -> None:
    stream, chunks = run_stream("completion_probs", "generate", top_logprobs=2)
    assert chunks[0]["logprobs"] == [
        {
            "token": " the",
            "logprob": -1.5936477184295654,
            "bytes": [32, 116, 104, 101],
            "top_logprobs": [
                {"token": " the", "logprob": -1.5936477184295654, "bytes": [32, 116, 104, 101]},
                {"token": " a", "logprob": -2.2898948192596436, "bytes": [32, 97]},
            ],
        }
    ]
    whole = stream.aggregate(load_duration_ns=0, total_duration_ns=1)
    assert [p["token"] for p in whole["logprobs"]] == [" the", " capital"]
    GenerateResponse.model_validate(whole)


def test_chat_stream_as_generate() -> None:
    """A templated /api/generate is served by /v1/chat/completions: "response" chunks."""
    stream, chunks = run_stream("chat_stream_len", "generate")
    assert [c["response"] for c in chunks] == ["<", "|", "im", "_"]  # the role-only delta: none
    final = final_of(stream)
    assert final["done_reason"] == "length"
    # no include_usage here: the prompt count is timings' prompt_n + cache_n
    assert (final["prompt_eval_count"], final["eval_count"]) == (26, 4)
    assert (final["prompt_eval_duration"], final["eval_duration"]) == (332_855_000, 317_266_000)


def test_chat_stream_with_usage() -> None:
    stream, chunks = run_stream("chat_n_predict_len", "chat")
    assert chunks == [
        {
            "model": "gemma3",
            "created_at": CREATED,
            "message": {"role": "assistant", "content": text},
            "done": False,
        }
        for text in ["<", "|", "im"]
    ]
    assert final_of(stream) == {
        "model": "gemma3",
        "created_at": CREATED,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "length",
        "total_duration": 1_000_000_000,
        "load_duration": 7,
        "prompt_eval_count": 28,
        "prompt_eval_duration": 365_186_000,
        "eval_count": 3,
        "eval_duration": 88_068_000,
    }


def test_chat_schema_stop_and_aggregate() -> None:
    stream, _ = run_stream("chat_schema", "chat")
    whole = stream.aggregate(load_duration_ns=5, total_duration_ns=10)
    ChatResponse.model_validate(whole)
    assert whole["done"] is True
    assert whole["done_reason"] == "stop"
    assert json.loads(whole["message"]["content"]) == {"name": "Assistant Manager"}
    assert whole["message"]["role"] == "assistant"
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (27, 16)
    assert (whole["load_duration"], whole["total_duration"]) == (5, 10)


def test_generate_aggregate() -> None:
    stream, _ = run_stream("completion_stream_len", "generate")
    whole = stream.aggregate(load_duration_ns=1, total_duration_ns=2)
    GenerateResponse.model_validate(whole)
    assert whole == {
        "model": "gemma3",
        "created_at": CREATED,
        "response": " the capital of the country",
        "done": True,
        "done_reason": "length",
        "total_duration": 2,
        "load_duration": 1,
        "prompt_eval_count": 6,
        "prompt_eval_duration": 130_437_000,
        "eval_count": 5,
        "eval_duration": 183_528_000,
    }


def test_chat_logprobs() -> None:
    _, chunks = run_stream("chat_logprobs", "chat", top_logprobs=2)
    assert [c["message"]["content"] for c in chunks] == ["<", "|"]
    assert chunks[1]["logprobs"] == [
        {
            "token": "|",
            "logprob": -0.025294063612818718,
            "bytes": [124],
            "top_logprobs": [
                {"token": "|", "logprob": -0.025294063612818718, "bytes": [124]},
                {"token": "im", "logprob": -6.146010398864746, "bytes": [105, 109]},
            ],
        }
    ]


@pytest.mark.parametrize("top", [0, 1])
def test_logprobs_carry_as_many_alternatives_as_asked(top: int) -> None:
    # llama-server is asked for at least one alternative (it reports nothing for 0); Ollama omits
    # top_logprobs when the request asked for none
    _, chunks = run_stream("chat_logprobs", "chat", top_logprobs=top)
    entry = chunks[1]["logprobs"][0]
    assert entry["token"] == "|" and entry["bytes"] == [124]
    assert len(entry.get("top_logprobs", [])) == top


def test_chat_continue_strips_the_echoed_prefill() -> None:
    up = chat_upstream(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Count to five"},
                {"role": "assistant", "content": "1, 2, 3,"},
            ],
        }
    )
    assert up.prefill == "1, 2, 3,"
    stream, chunks = run_stream("chat_continue", "chat", prefill=up.prefill)
    assert [c["message"]["content"] for c in chunks] == [" ", "4", ",", " "]
    assert stream.aggregate(load_duration_ns=0, total_duration_ns=0)["message"]["content"] == " 4, "
    # without the prefill, the echo passes through as llama-server sent it
    _, echoed = run_stream("chat_continue", "chat")
    assert echoed[0]["message"]["content"] == "1, 2, 3, "


@pytest.mark.parametrize(
    ("pieces", "prefill", "out"),
    [
        (["abc", "d"], "ab", ["c", "d"]),
        (["a", "b", "cd"], "abc", ["", "", "d"]),
        (["x", "ab"], "ab", ["x", "ab"]),
        (["ab"], "", ["ab"]),
    ],
)
def test_prefill_strip_across_pieces(pieces: list[str], prefill: str, out: list[str]) -> None:
    stream = OllamaStream("chat", "m", created_at_fn=fixed_clock, prefill=prefill)
    got = []
    for piece in pieces:
        chunks = stream.feed({"choices": [{"index": 0, "delta": {"content": piece}}]})
        got.append(chunks[0]["message"]["content"] if chunks else "")
    assert got == out


def test_chat_upstream_prefill_only_for_final_assistant() -> None:
    up = chat_upstream({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert up.prefill == ""


def test_with_defaults_keeps_request_values_and_fields() -> None:
    up = chat_upstream(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "options": {"temperature": 0.5, "num_ctx": 1024},
        }
    )
    merged = up.with_defaults({"temperature": 0.1, "top_k": 20})
    assert merged.body["temperature"] == 0.5
    assert merged.body["top_k"] == 20
    assert (merged.path, merged.runner_options, merged.prefill) == (up.path, {"num_ctx": 1024}, "y")


@pytest.mark.parametrize(
    ("name", "status", "message"),
    [
        ("infill", 501, "Infill is not supported by this model: prefix token is missing."),
        (
            "chat_too_long",
            400,
            "request (3024 tokens) exceeds the available context size (2048 tokens)",
        ),
        ("chat_image_no_mmproj", 500, "image input is not supported"),
    ],
)
def test_upstream_error_bodies(name: str, status: int, message: str) -> None:
    """Errors before the first event are plain HTTP responses with an OpenAI-style body."""
    got_status, body = ERROR_BODIES[name]
    assert got_status == status
    assert upstream_error_message(json.loads(body)).startswith(message)


def test_unfinished_stream() -> None:
    """A stream cut off before its final event is not ``finished``; finish() still validates."""
    stream = OllamaStream("generate", "m", created_at_fn=fixed_clock)
    feed_all(stream, SAMPLES["completion_stream_len"][:4])
    assert not stream.finished
    final = final_of(stream)
    assert final["done_reason"] == "stop"
    assert final["eval_count"] == 2  # pieces seen, lacking llama-server's count
    assert (
        stream.finish(load_duration_ns=0, total_duration_ns=0, done_reason="length")["done_reason"]
        == "length"
    )


# --------------------------------------------------------------------------------------------
# tool calls and thinking (llama-server streams OpenAI-style deltas; gemma3-270m calls no tools,
# so these events follow the shape llama-server's to_json_oaicompat_chat_stream writes)
# --------------------------------------------------------------------------------------------

TOOL_CALL_EVENTS: list[dict[str, Any]] = [
    {
        "choices": [
            {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}
        ]
    },
    {
        "choices": [
            {"finish_reason": None, "index": 0, "delta": {"reasoning_content": "Need weather."}}
        ]
    },
    {
        "choices": [
            {
                "finish_reason": None,
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"ci'},
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "finish_reason": None,
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
            }
        ]
    },
    {"choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}]},
    {
        "choices": [],
        "usage": {"completion_tokens": 9, "prompt_tokens": 40, "total_tokens": 49},
        "timings": {
            "cache_n": 0,
            "prompt_n": 40,
            "prompt_ms": 10.0,
            "predicted_n": 9,
            "predicted_ms": 20.0,
        },
    },
]


def test_tool_calls_sent_whole_when_finished() -> None:
    stream = OllamaStream("chat", "m", created_at_fn=fixed_clock)
    chunks = [c for event in TOOL_CALL_EVENTS for c in stream.feed(event)]
    for chunk in chunks:
        validate("chat", chunk)
    assert chunks == [
        {
            "model": "m",
            "created_at": CREATED,
            "message": {"role": "assistant", "content": "", "thinking": "Need weather."},
            "done": False,
        },
        {
            "model": "m",
            "created_at": CREATED,
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        "id": "call_1",
                    }
                ],
            },
            "done": False,
        },
    ]
    final = final_of(stream)
    assert final["done_reason"] == "stop"
    assert "tool_calls" not in final["message"]
    whole = stream.aggregate(load_duration_ns=0, total_duration_ns=0)
    ChatResponse.model_validate(whole)
    assert whole["message"]["thinking"] == "Need weather."
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_tool_call_with_bad_arguments() -> None:
    stream = OllamaStream("chat", "m", created_at_fn=fixed_clock)
    stream.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "function": {"name": "f", "arguments": "{oops"}}
                        ]
                    },
                }
            ]
        }
    )
    with pytest.raises(UpstreamError, match="not JSON"):
        stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})


def test_generate_thinking_field() -> None:
    stream = OllamaStream("generate", "m", created_at_fn=fixed_clock)
    chunks = stream.feed({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
    assert chunks == [
        {"model": "m", "created_at": CREATED, "response": "", "thinking": "hmm", "done": False}
    ]
    validate("generate", chunks[0])
    assert stream.aggregate(load_duration_ns=0, total_duration_ns=0)["thinking"] == "hmm"


def test_stream_kind_is_checked() -> None:
    with pytest.raises(ValueError):
        OllamaStream("embed", "m")  # type: ignore[arg-type]




# -- the byte path (feed_lines_bytes): exactly the general path's bytes --------------------------

def _tricky_events() -> list[str]:
    texts = [" plain", "", "quote \" and \\ backslash", "new\nline\ttab", "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600",
             "\u0001 control", "</script>", '"stop":false', "\u2028 separator", "\\u0041 not an escape"]  # fmt: skip
    lines = []
    for i, text in enumerate(texts):
        content = json.dumps(text, ensure_ascii=False, separators=(",", ":"))
        lines.append(f'data: {{"index":0,"content":{content},"tokens":[{i}],"stop":false,"id_slot":-1,"tokens_predicted":{i + 1},"tokens_evaluated":3}}')
        lines.append(f'data: {{"choices":[{{"finish_reason":null,"index":0,"delta":{{"content":{content}}}}}],"created":1,"id":"x","model":"m\\"q","system_fingerprint":"b1-x","object":"chat.completion.chunk"}}')  # fmt: skip
    # not plain: general way
    lines.append('data: {"index":0,"content":" p","tokens":[1],"stop":false,"completion_probabilities":[{"id":1,"token":" p","bytes":[32,112],"logprob":-0.5,"top_logprobs":[]}]}')  # fmt: skip
    lines.append('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"hm"}}],"created":1,"id":"x","model":"m","object":"chat.completion.chunk"}')  # fmt: skip
    lines.append('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" t"}}],"created":1,"id":"x","model":"m","object":"chat.completion.chunk","timings":{"predicted_n":3}}')  # fmt: skip
    return lines


@pytest.mark.parametrize("kind", ["generate", "chat"])
@pytest.mark.parametrize("name", [*SAMPLES, "tricky"])
def test_the_byte_path_writes_exactly_what_the_general_path_writes(kind: str, name: str) -> None:
    lines = _tricky_events() if name == "tricky" else SAMPLES[name]
    encoded = [line.encode() for line in lines]
    general = OllamaStream(kind, "gemma3:\u00e9", created_at_fn=fixed_clock)  # type: ignore[arg-type]
    fast = OllamaStream(kind, "gemma3:\u00e9", created_at_fn=fixed_clock)  # type: ignore[arg-type]
    try:
        expected = b"".join(json.dumps(c, ensure_ascii=False).encode() + b"\n" for c in general.feed_lines(encoded))
    except UpstreamError:
        with pytest.raises(UpstreamError):
            fast.feed_lines_bytes(encoded)
        return
    got = fast.feed_lines_bytes(encoded)
    assert got == expected
    assert fast.text == general.text and fast.finished == general.finished
    final = dict(load_duration_ns=1, total_duration_ns=2)
    assert fast.finish(**final) == general.finish(**final)


def test_the_byte_path_takes_the_plain_events_and_only_those() -> None:
    """The fast shape matches the recorded plain events (else it would never pay) and none of
    the others (else their logprobs, timings or reasoning would be lost: the test above)."""
    from trioshed.api.protocols.ollama_stream import _CHAT_PIECE, _COMPLETION_PIECE

    plain = [line for line in _tricky_events()[:-3]]
    assert all(_COMPLETION_PIECE.match(line.encode()) or _CHAT_PIECE.match(line.encode()) for line in plain)
    for name in ("completion_stream_len", "chat_stream_len"):  # as b10068 writes them
        assert _COMPLETION_PIECE.match(SAMPLES[name][2].encode()) or _CHAT_PIECE.match(SAMPLES[name][2].encode())
