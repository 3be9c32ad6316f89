"""What llama-server's own routes accept, and what /upstream/<model>/<path> forwards (pure)."""

from __future__ import annotations

import json

import pytest

from trioshed.api.protocols.llama_tools import (
    UPSTREAM_GET,
    UPSTREAM_POST,
    scrub_props,
    split_upstream,
    tool_body,
    upstream_allowed,
)
from trioshed.errors import BadRequest, Forbidden


def test_trioshed_fields_never_go_upstream() -> None:
    body = {"model": "m", "keep_alive": "1m", "options": {"num_ctx": 64}, "input_prefix": "a", "input_suffix": "b", "n_predict": 3}
    assert tool_body("/infill", body) == {"input_prefix": "a", "input_suffix": "b", "n_predict": 3}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/infill", {"input_suffix": ["x"]}, '"input_suffix" must be a string, got array'),
        ("/infill", {"n_probs": True}, '"n_probs" must be an integer, got boolean'),
        ("/infill", {"temperature": "0"}, '"temperature" must be a number'),
        ("/infill", {"stop": ["a", 1]}, '"stop" must be a list of strings'),
        ("/infill", {"input_extra": ["x"]}, "input_extra[0]"),
        ("/tokenize", {"with_pieces": "yes"}, '"with_pieces" must be true or false'),
        ("/detokenize", {"tokens": [1.5]}, "token ids"),
        ("/detokenize", {"tokens": [True]}, "token ids"),
        ("/apply-template", {}, '"messages" is required'),
        ("/apply-template", {"messages": [{"content": "x"}]}, "messages[0]"),
    ],
)
def test_wrong_types_are_refused_with_the_field_named(path: str, body: dict[str, object], words: str) -> None:
    with pytest.raises(BadRequest) as caught:
        tool_body(path, body)
    assert words in caught.value.message


def test_numbers_may_be_integers_where_floats_are_read() -> None:
    assert tool_body("/infill", {"temperature": 0, "top_p": 1})["temperature"] == 0


def test_upstream_readings_put_forwarded_paths_first_and_keep_slashed_model_names() -> None:
    assert split_upstream("tiny/props") == [("tiny", "/props")]
    readings = split_upstream("hf.co/org/repo:Q4/v1/chat/completions")
    # every reading whose path is a route comes first, shortest model first: the store decides
    assert readings == [
        ("hf.co/org/repo:Q4", "/v1/chat/completions"),
        ("hf.co/org/repo:Q4/v1", "/chat/completions"),
        ("hf.co/org/repo:Q4/v1/chat", "/completions"),
        ("hf.co", "/org/repo:Q4/v1/chat/completions"),
        ("hf.co/org", "/repo:Q4/v1/chat/completions"),
    ]


@pytest.mark.parametrize(
    ("rest", "raw"),
    [
        ("tiny/../props", b""),
        ("tiny/./props", b""),
        ("tiny//props", b""),
        ("tiny/props/", b""),
        ("tiny", b""),
        ("tiny/a\\b", b""),
        ("tiny/pr\x00ops", b""),
        ("tiny/props", b"/upstream/tiny%2Fprops"),
        ("tiny/props", b"/upstream/tiny/%2e%2e/props"),
        ("tiny/props", b"/upstream/tiny/%5Cprops"),
    ],
)
def test_paths_that_could_step_out_are_refused(rest: str, raw: bytes) -> None:
    with pytest.raises(BadRequest):
        split_upstream(rest, raw)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/slots"),
        ("POST", "/slots/0"),
        ("POST", "/props"),
        ("POST", "/lora-adapters"),
        ("GET", "/lora-adapters"),
        ("POST", "/models/load"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/tokenize"),
        ("PUT", "/completion"),
    ],
)
def test_what_writes_files_changes_a_runner_or_is_unknown_is_not_forwarded(method: str, path: str) -> None:
    with pytest.raises(Forbidden):
        upstream_allowed(method, path)


def test_reading_and_generating_routes_are_forwarded() -> None:
    for path in UPSTREAM_GET:
        upstream_allowed("GET", path)
    for path in UPSTREAM_POST:
        upstream_allowed("POST", path)


def test_props_never_names_the_models_file() -> None:
    raw = json.dumps({"model_path": "/home/u/models/m.gguf", "total_slots": 1}).encode()
    assert json.loads(scrub_props(raw, "m")) == {"model_path": "m", "total_slots": 1}
    assert scrub_props(b"not json", "m") == b"not json"
