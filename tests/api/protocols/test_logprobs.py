"""Log-probabilities translated between llama-server and OpenAI's shapes (pure)."""

from __future__ import annotations

import json
from typing import Any

from trioshed.api.protocols.openai_chat import (
    CompletionAsChat,
    LegacyLogprobs,
    as_chat,
    completion_logprobs_asked,
    logprobs_asked,
    transcript_completion_body,
)


def _entry(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict[str, Any]:
    return {"id": 1, "token": token, "bytes": list(token.encode()), "logprob": logprob,
            "top_logprobs": [{"id": 2, "token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in alternatives]}  # fmt: skip


ANSWER = {
    "choices": [{"text": "ab", "index": 0, "finish_reason": "length",
                 "logprobs": {"content": [_entry("a", -0.1, ("a", -0.1), ("b", -2.0)), _entry("b", -0.2, ("b", -0.2), ("c", -3.0))]}}],
    "model": "m", "object": "text_completion",
}  # fmt: skip


def test_chat_logprobs_on_the_transcript_path_ask_completions_for_a_count() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}
    out = transcript_completion_body(body)
    assert (out["logprobs"], out["top_logprobs"]) == (3, 3) and logprobs_asked(out) == 3
    zero = transcript_completion_body({**body, "top_logprobs": None})
    assert zero["logprobs"] == 1 and logprobs_asked(zero) == 0  # llama-server reports nothing for 0
    assert "logprobs" not in transcript_completion_body({**body, "logprobs": False})
    assert logprobs_asked(transcript_completion_body({"messages": body["messages"]})) is None


def test_the_answer_in_chats_shape_keeps_as_many_alternatives_as_asked() -> None:
    chat = as_chat(json.loads(json.dumps(ANSWER)), top_logprobs=1)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["a", "b"] and [len(e["top_logprobs"]) for e in content] == [1, 1]
    assert "logprobs" not in as_chat(json.loads(json.dumps(ANSWER)))["choices"][0]  # not asked: not given
    event = b"data: " + json.dumps(ANSWER).encode()
    streamed = CompletionAsChat("m", top_logprobs=0).feed_lines([event])
    chunk = json.loads(streamed.split(b"\n")[0][6:])
    assert [e["top_logprobs"] for e in chunk["choices"][0]["logprobs"]["content"]] == [[], []]


def test_completions_logprobs_get_openais_fields_beside_llama_servers() -> None:
    out = LegacyLogprobs(prompt_chars=5).event(json.loads(json.dumps(ANSWER)))
    lp = out["choices"][0]["logprobs"]
    assert lp["content"] == ANSWER["choices"][0]["logprobs"]["content"]  # llama-server's own, unchanged
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.1, -0.2]
    assert lp["top_logprobs"] == [{"a": -0.1, "b": -2.0}, {"b": -0.2, "c": -3.0}]
    assert lp["text_offset"] == [5, 6]


def test_streamed_offsets_continue_from_event_to_event_per_choice() -> None:
    legacy = LegacyLogprobs()
    one = {"choices": [{"index": 0, "text": "ab", "logprobs": {"content": [_entry("ab", -1.0)]}}]}
    two = {"choices": [{"index": 0, "text": "c", "logprobs": {"content": [_entry("c", -1.0)]}}]}
    done = {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (one, two, done)) + b"data: [DONE]\n\n"
    lines = [line for line in legacy.lines(data).split(b"\n") if line.startswith(b"data: {")]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["choices"][0]["logprobs"] and e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0], [2], None]
    assert legacy.lines(data).endswith(b"data: [DONE]\n\n")


def test_completions_logprobs_are_a_count() -> None:
    assert completion_logprobs_asked({"logprobs": 2}) and completion_logprobs_asked({"logprobs": 0})
    assert not completion_logprobs_asked({"logprobs": True}) and not completion_logprobs_asked({})
