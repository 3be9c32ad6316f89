"""Ollama requests as llama-server requests (trioshed.api.protocols.options, .ollama): plain ``def test_``."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
from ollama._types import ChatResponse, GenerateResponse

from tests.api.protocols.recorded_llama import (
    CREATED,
)
from trioshed.api.protocols.llama import Upstream
from trioshed.api.protocols.ollama import (
    chat_upstream,
    generate_upstream,
    is_load_only,
    load_response,
    now_rfc3339,
    rfc3339,
)
from trioshed.api.protocols.options import RUNNER_OPTION_KEYS, split_options
from trioshed.errors import BadRequest

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


@pytest.mark.parametrize("micros", [0, 1, 10, 120_000, 999_999, 1_733_350_000_000_000, 1_733_350_000_500_000, 1_733_350_059_999_990])
def test_rfc3339_is_datetimes_own_spelling(micros: int) -> None:
    """The stamp of each chunk, built from a cached second and the microseconds, is what
    datetime's strftime writes (the form Ollama's ``created_at`` takes), at whole seconds too."""
    from datetime import UTC, datetime, timedelta

    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)
    expected = when.strftime("%Y-%m-%dT%H:%M:%S.%f").rstrip("0").rstrip(".") + "Z"
    assert rfc3339(micros) == expected
    assert rfc3339(micros) == expected  # the cached second gives the same answer



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


