"""OpenAI pass-through: llama-server's SSE bytes relayed unchanged but for the model's name."""

from __future__ import annotations

import json

from trioshed.api.protocols.openai_chat import ModelRenamer


def _event(model: str, content: str) -> bytes:
    # llama-server's own serialization: no spaces, the model field in every chunk
    return b'data: {"choices":[{"index":0,"delta":{"content":' + json.dumps(content).encode() + (
        b'}}],"created":1,"id":"chatcmpl-x","model":' + json.dumps(model, ensure_ascii=False).encode()
        + b',"object":"chat.completion.chunk"}\n\n'
    )


def _relay(renamer: ModelRenamer, data: bytes, cuts: list[int]) -> bytes:
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return b"".join(renamer.feed(p) for p in pieces) + renamer.finish()


STREAM = _event("tiny:latest", "Hel") + _event("tiny:latest", 'say "model":"tiny:latest"') + b"data: [DONE]\n\n"


def test_bytes_pass_unchanged_but_the_model_field_at_any_split() -> None:
    expected = STREAM.replace(b'"model":"tiny:latest"', b'"model":"tiny"')
    # the content's own quotes are escaped, so it keeps its text
    assert b'say \\"model\\":\\"tiny:latest\\"' in expected
    for cut in range(1, len(STREAM)):
        assert _relay(ModelRenamer("tiny:latest", "tiny"), STREAM, [cut]) == expected
    assert _relay(ModelRenamer("tiny:latest", "tiny"), STREAM, list(range(1, len(STREAM)))) == expected


def test_events_still_parse_and_name_the_model_as_asked() -> None:
    out = ModelRenamer("tiny:latest", "Tiny/ünï").feed(STREAM)
    events = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [e["model"] for e in events] == ["Tiny/ünï", "Tiny/ünï"]
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["Hel", 'say "model":"tiny:latest"']


def test_same_name_is_untouched() -> None:
    assert _relay(ModelRenamer("tiny:latest", "tiny:latest"), STREAM, [7]) == STREAM


def test_an_unexpected_upstream_name_is_learned_from_the_first_event() -> None:
    stream = _event("/models/tiny.gguf", "a") + _event("/models/tiny.gguf", "b")
    out = ModelRenamer("tiny:latest", "tiny").feed(stream)
    assert out == stream.replace(b'"model":"/models/tiny.gguf"', b'"model":"tiny"')


def test_a_field_in_another_spelling_falls_back_to_parsing_each_event() -> None:
    stream = b'data: {"model": "other", "choices": []}\n\n' * 2  # spaces: not llama-server's style
    out = ModelRenamer("tiny:latest", "tiny").feed(stream)
    events = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    assert events == [{"model": "tiny", "choices": []}] * 2


def test_ollama_batch_translation_matches_event_by_event_with_one_stamp_per_batch() -> None:
    from trioshed.api.protocols.llama import parse_sse_line
    from trioshed.api.protocols.ollama_stream import OllamaStream

    lines = [
        b'data: {"index":0,"content":"Hel","stop":false}', b"",
        b'data: {"index":0,"content":"lo","stop":false}', b"",
        b'data: {"index":0,"content":"","stop":true,"stop_type":"limit","tokens_evaluated":3,"tokens_predicted":2}', b"",
    ]  # fmt: skip
    stamps = iter(f"t{i}" for i in range(100))
    batched = OllamaStream("generate", "m", created_at_fn=lambda: next(stamps))
    chunks = batched.feed_lines(lines)
    one_by_one = OllamaStream("generate", "m", created_at_fn=lambda: "t0")
    expected = [c for line in lines if (e := parse_sse_line(line)) is not None for c in one_by_one.feed(e)]
    assert chunks == expected and [c["response"] for c in chunks] == ["Hel", "lo"]
    assert batched.finished and batched.finish(load_duration_ns=0, total_duration_ns=1)["created_at"] == "t1"
