"""A transcript with images and sounds where they stood (pure): the media marker in the text,
the bytes in order, and llama-server's /completion answers read in /v1/completions' shape."""

from __future__ import annotations

import json

import pytest

from trioshed.api.protocols.ollama import generate_upstream, transcript_upstream
from trioshed.api.protocols.openai_chat import transcript_completion_body, transcript_path
from trioshed.api.protocols.transcript import (
    completion_event,
    completion_lines,
    transcript_media,
    transcript_prompt,
)
from trioshed.core.media import MEDIA_MARKER as M
from trioshed.errors import BadRequest

PNG = "iVBORw0KGgo="  # base64 of a PNG's signature
WAV = "UklGRiQAAABXQVZF"  # base64 of "RIFF....WAVE"


def test_media_stand_where_they_were_in_every_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                                     {"type": "text", "text": " b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}]},
    ]  # fmt: skip
    text, media = transcript_media(messages)
    assert text == f"Be brief.\n\nUser: a {M} b\nAssistant: ok\nUser: {M}\nAssistant:"
    assert media == [PNG, WAV]
    assert transcript_prompt(messages) == "Be brief.\n\nUser: a  b\nAssistant: ok\nUser: \nAssistant:"  # text only
    assert M.startswith("<__media_") and len(M) > 40  # drawn per process, not guessable


def test_an_image_from_a_url_is_refused_with_the_reason() -> None:
    with pytest.raises(BadRequest, match="data: URI"):
        transcript_media([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}}]}])


def test_each_protocols_body_carries_the_multimodal_prompt() -> None:
    ollama = transcript_upstream({"model": "m", "messages": [{"role": "user", "content": "hi", "images": [PNG]}]})
    assert ollama.path == "/completion"
    assert ollama.body["prompt"] == {"prompt_string": f"User: {M}hi\nAssistant:", "multimodal_data": [PNG]}
    generate = generate_upstream({"prompt": "look", "system": "S", "images": [PNG, WAV]}, chat_template=False)
    assert generate.body["prompt"] == {"prompt_string": f"S\n\n{M}{M}look", "multimodal_data": [PNG, WAV]}
    with pytest.raises(BadRequest, match="raw"):
        generate_upstream({"prompt": "look", "raw": True, "images": [PNG]})  # a raw prompt says where media go itself
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}], "max_tokens": 3}
    body = transcript_completion_body(chat)
    assert transcript_path(body) == "/completion" and body["prompt"]["multimodal_data"] == [PNG] and body["max_tokens"] == 3
    assert transcript_path(transcript_completion_body({"messages": [{"role": "user", "content": "hi"}]})) == "/v1/completions"
    with pytest.raises(BadRequest, match="logprobs"):
        transcript_completion_body({**chat, "logprobs": True})


def test_completion_answers_read_as_v1_completions() -> None:
    assert completion_event({"content": "ab", "stop": False}) == {
        "object": "text_completion", "model": "", "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}  # fmt: skip
    last = completion_event({"content": "", "stop": True, "stop_type": "limit", "tokens_evaluated": 40, "tokens_predicted": 3, "timings": {"prompt_n": 40}})
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43}
    assert completion_event({"stop": True, "stop_type": "word"})["choices"][0]["finish_reason"] == "stop"
    lines = completion_lines([b'data: {"content": "x", "stop": false}', b"", b'data: {"content": "", "stop": true, "stop_type": "eos"}', b""])
    assert lines[-3:] == [b"", b"data: [DONE]", b""]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "x"
