"""The agent model (:mod:`trioshed.testing.agent_model`) against the real llama-server alone:
every byte a token, a long prompt read in about a second, one answer and the end of the turn
whatever the sampler."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from trioshed.testing.agent_model import (
    AGENT_ANSWER,
    answer_tokens,
    byte_vocabulary,
    write_agent_model,
)
from trioshed.testing.llama import running_llama_server

pytestmark = pytest.mark.slow

#: Claude Code's prompts hold these (an em dash, a check mark, an emoji): four-byte UTF-8 too.
TEXT = "Résumé — naïve café ✓ 日本語 🤖 The quick brown fox jumps over the lazy dog.\n"


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        data: dict[str, Any] = json.load(answer)
    return data


def test_the_vocabulary_spells_any_text_one_token_per_byte() -> None:
    tokens, _, _ = byte_vocabulary()
    assert len(tokens) == 3 + 256 + 1
    assert answer_tokens("Done ✓") == [3 + ord(c) for c in "Done"] + [259] + [3 + b for b in "✓".encode()]
    with pytest.raises(ValueError, match="each byte once"):
        write_agent_model(os.devnull, answer="Hello")  # two l's: no chain


def test_the_same_arguments_give_the_same_bytes(tmp_path: Path) -> None:
    a, b = write_agent_model(tmp_path / "a.gguf"), write_agent_model(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes() and a.stat().st_size < 64_000


def test_a_long_non_ascii_prompt_is_read_and_answered_once_then_the_turn_ends(tmp_path: Path) -> None:
    model = write_agent_model(tmp_path / "agent.gguf")
    with running_llama_server(model, ["-c", "131072", "-t", "1", "-ngl", "0", "--fit", "off", "--jinja"]) as server:
        tokenized = _post(server.url, "/tokenize", {"content": TEXT, "add_special": False})["tokens"]
        # a byte a token, a space ▁ (and SentencePiece's ▁ before the text)
        assert len(tokenized) == 1 + len(TEXT.replace(" ", "").encode()) + TEXT.count(" ")
        assert _post(server.url, "/detokenize", {"tokens": tokenized})["content"] == " " + TEXT
        prompt = TEXT * (95_000 // len(TEXT.encode()))
        started = time.monotonic()
        answer = _post(server.url, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "Say it."}],
            "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        })  # fmt: skip
        took = time.monotonic() - started
        choice = answer["choices"][0]
        assert choice["message"]["content"] == AGENT_ANSWER and choice["finish_reason"] == "stop"
        assert answer["usage"]["prompt_tokens"] > 95_000 and answer["usage"]["completion_tokens"] == len(answer_tokens(AGENT_ANSWER)) + 1
        assert took < 60, f"a 95k-token prompt took {took:.1f} s"  # about a second on one core; a loaded 2-core CI box: a few
        # with tools offered the answer is still text: it never starts a tool call
        tools = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
        answer = _post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}], "tools": tools})
        assert answer["choices"][0]["message"]["content"] == AGENT_ANSWER and not answer["choices"][0]["message"].get("tool_calls")
