"""The runner's context: trained context, automatic size, clamp (pure), and the request's need."""

from __future__ import annotations

from trioshed.api.pipeline.preamble import MEDIA_TOKENS, request_need
from trioshed.core.context import (
    FLOOR,
    automatic_context,
    bucket,
    clamp,
    tokens_upper_bound,
    trained_context,
)
from trioshed.core.model import RunnerOptions


def test_trained_context_plain_and_rope_scaled() -> None:
    assert trained_context(8192) == 8192
    assert trained_context(0) == 0
    # Qwen2.5 with YaRN: context_length 32768, factor 4 over the original 32768
    assert trained_context(32768, scaling_type="yarn", factor=4.0, original=32768) == 131072
    assert trained_context(4096, scaling_type="linear", factor=2.0) == 8192  # no original: the base
    assert trained_context(131072, scaling_type="yarn", factor=4.0, original=8192) == 131072  # already longer
    assert trained_context(8192, scaling_type="none", factor=4.0) == 8192
    assert trained_context(8192, scaling_type="yarn", factor=1.0) == 8192


def test_buckets_double_from_the_floor() -> None:
    assert [bucket(n) for n in (0, 1, FLOOR, FLOOR + 1, 3 * FLOOR, 20_000, 32_768)] == [
        4096, 4096, 4096, 8192, 16384, 32768, 32768,
    ]


def test_automatic_context_within_trained_and_cap() -> None:
    assert automatic_context(100, 32768) == FLOOR
    assert automatic_context(6_100, 32768) == 8192
    assert automatic_context(20_500, 32768) == 32768
    assert automatic_context(90_000, 32768) == 32768  # never past the trained context
    assert automatic_context(100, 512) == 512  # a BERT model: its position table
    assert automatic_context(20_500, 32768, cap=16384) == 16384
    assert automatic_context(100, 0) == FLOOR  # unknown trained context: the bucket alone
    assert automatic_context(9_000, 0, cap=8192) == 8192


def test_clamp_context_and_batch() -> None:
    opts = RunnerOptions(num_ctx=4096, num_batch=512)
    assert clamp(opts, 512) == RunnerOptions(num_ctx=512, num_batch=512)
    assert clamp(opts, 256) == RunnerOptions(num_ctx=256, num_batch=256)  # batch never above context
    assert clamp(opts, 0) is opts  # unknown: unchanged
    assert clamp(opts, 8192) is opts
    assert clamp(RunnerOptions(num_ctx=64, num_batch=512), 8192).num_batch == 64


def test_upper_bound_adds_template_markers_and_output() -> None:
    assert tokens_upper_bound(1000) == 1000 + 16
    assert tokens_upper_bound(1000, messages=3, output=200) == 1000 + 48 + 200


def test_request_need_counts_text_bytes_media_and_output() -> None:
    text = "héllo " * 1000  # 7 bytes each
    chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 300}
    need = request_need(chat)
    assert need >= len(text.encode()) + 300
    assert need < len(text.encode()) + 300 + 200
    ollama = {"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["AAAA", "BBBB"]}],
              "options": {"num_predict": 50}}  # fmt: skip
    assert request_need(ollama) >= 2 * MEDIA_TOKENS + 50
    anthropic = {"model": "m", "system": "s" * 5000, "max_tokens": 10,
                 "tools": [{"name": "t", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}],
                 "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "A" * 99999}}]}]}  # fmt: skip
    need = request_need(anthropic)
    assert 5000 + MEDIA_TOKENS + 10 < need < 5000 + MEDIA_TOKENS + 10 + 500  # the base64 counted as one image
    openai_img = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 50000}}]}]}
    assert request_need(openai_img) < MEDIA_TOKENS + 300


def test_metadata_trained_context_reads_rope_scaling() -> None:
    from trioshed.models.gguf_meta import GGUFMetadata

    plain = GGUFMetadata("m", 3, {"general.architecture": "qwen2", "qwen2.context_length": 32768}, (), 0)
    assert plain.trained_context == 32768
    yarn = GGUFMetadata(
        "m", 3,
        {"general.architecture": "qwen2", "qwen2.context_length": 32768, "qwen2.rope.scaling.type": "yarn",
         "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.original_context_length": 32768}, (), 0,
    )  # fmt: skip
    assert yarn.trained_context == 131072


def _state(tmp_path, settings, toml: str = ""):  # type: ignore[no-untyped-def]
    from trioshed.api.state import AppState
    from trioshed.models.store import ModelStore
    from trioshed.testing.tiny import write_tiny_model

    write_tiny_model(tmp_path / "small.gguf", context_length=512)
    write_tiny_model(tmp_path / "long.gguf", context_length=32768)
    if toml:
        (tmp_path / "models.toml").write_text(toml)
    store = ModelStore(tmp_path)
    return AppState(settings=settings, store=store, scheduler=None), store  # type: ignore[arg-type]


def test_runner_options_automatic_by_default_and_clamped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from trioshed.config import Settings

    state, store = _state(tmp_path, Settings())
    long, small = store.resolve("long"), store.resolve("small")
    assert state.runner_options(long, {}).num_ctx == FLOOR
    assert state.runner_options(long, {}, need=6_000).num_ctx == 8192
    assert state.runner_options(long, {}, need=25_000).num_ctx == 32768
    assert state.runner_options(long, {}, need=99_000).num_ctx == 32768
    small_options = state.runner_options(small, {})
    assert (small_options.num_ctx, small_options.num_batch) == (512, 512)
    assert state.runner_options(long, {"num_ctx": 2048}, need=25_000).num_ctx == 2048  # the request's word
    clamped = state.runner_options(small, {"num_ctx": 8192, "num_batch": 2048})
    assert (clamped.num_ctx, clamped.num_batch) == (512, 512)
    capped, _ = _state(tmp_path, Settings(context_max=16384))
    assert capped.runner_options(long, {}, need=25_000).num_ctx == 16384


def test_runner_options_set_by_settings_or_models_toml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from trioshed.config import Settings

    state, store = _state(tmp_path, Settings(context_length=8192))
    assert state.runner_options(store.resolve("long"), {}, need=25_000).num_ctx == 8192  # set: not automatic
    assert state.runner_options(store.resolve("small"), {}).num_ctx == 512  # and still clamped
    toml = (
        '[models.small]\npath = "small.gguf"\nnum_ctx = 4096\n\n'
        '[models.roped]\npath = "small.gguf"\nnum_ctx = 4096\nargs = ["--rope-scale", "4"]\n'
    )
    (tmp_path / "x").mkdir()
    state, store = _state(tmp_path / "x", Settings(), toml)
    assert state.runner_options(store.resolve("small"), {}).num_ctx == 512
    assert state.runner_options(store.resolve("roped"), {}).num_ctx == 2048  # 512 x 4


def test_llama_servers_context_error_becomes_context_too_long() -> None:
    import json

    from trioshed.api.protocols.errors import context_error

    raw = json.dumps({"error": {"code": 400, "message": "request (5939 tokens) exceeds the available context size (4096 tokens), try increasing it",
                                "type": "exceed_context_size_error", "n_prompt_tokens": 5939, "n_ctx": 4096}}).encode()  # fmt: skip
    err = context_error(raw)
    assert err is not None and (err.prompt_tokens, err.n_ctx) == (5939, 4096)
    words = b'{"error": "request (700 tokens) exceeds the available context size (512 tokens), try increasing it"}'
    err = context_error(words)
    assert err is not None and (err.prompt_tokens, err.n_ctx) == (700, 512)
    assert context_error(b'{"error": {"message": "bad sampler", "type": "invalid_request_error"}}') is None
    assert context_error(b"not json, exceeds nothing") is None


def test_each_protocol_words_a_prompt_too_long() -> None:
    import json

    from trioshed.api.protocols.errors import error_parts, message_for
    from trioshed.errors import ContextTooLong

    exc = ContextTooLong(40_123, 32_768)
    status, _, body = error_parts("/v1/chat/completions", exc)
    openai = json.loads(body)["error"]
    assert status == 400 and openai["code"] == "context_length_exceeded" and openai["type"] == "invalid_request_error"
    assert openai["param"] == "messages"
    assert openai["message"] == ("This model's maximum context length is 32768 tokens. However, your messages "
                                 "resulted in 40123 tokens. Please reduce the length of the messages.")  # fmt: skip
    status, _, body = error_parts("/v1/messages", exc)
    assert status == 400 and json.loads(body) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 40123 tokens > 32768 maximum"},
    }  # fmt: skip
    status, _, body = error_parts("/api/chat", exc)
    assert status == 400 and json.loads(body) == {"error": "the input length exceeds the context length (40123 tokens > 32768 maximum)"}
    assert message_for("/v1/messages", exc).startswith("prompt is too long")
    assert message_for("/v1/responses", exc).startswith("This model's maximum context length")
