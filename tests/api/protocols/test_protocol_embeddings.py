"""Embeddings requests and answers (trioshed.api.protocols.embeddings)."""

from __future__ import annotations

from typing import Any

import pytest

from trioshed.api.protocols.embeddings import (
    embed_response,
    embed_upstream,
    embeddings_response,
    embeddings_upstream,
)
from trioshed.api.protocols.llama import Upstream
from trioshed.api.protocols.ollama import (
    is_load_only,
)
from trioshed.errors import BadRequest, UpstreamError

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


def test_truncated_tokens_keep_the_models_special_tokens() -> None:
    from trioshed.api.protocols.embeddings import truncated_tokens

    # BERT-style: [CLS] text [SEP]
    assert truncated_tokens([101, 1, 2, 3, 4, 102], [1, 2, 3, 4], [101, 102], 4) == [101, 1, 2, 102]
    # llama-style: BOS text
    assert truncated_tokens([1, 7, 8, 9], [7, 8, 9], [1], 3) == [1, 7, 8]
    # no special tokens
    assert truncated_tokens([5, 6, 7], [5, 6, 7], [], 2) == [5, 6]
    # a text that tokenizes differently alone: cut the whole as it is
    assert truncated_tokens([1, 9, 9, 9], [8, 8, 8], [1], 2) == [1, 9]


def test_limits_and_words_of_an_over_long_input() -> None:
    from trioshed.api.protocols.embeddings import runner_limit, too_long, too_long_message

    raw = b'{"error":{"message":"input (4202 tokens) is too large to process. increase the physical batch size (current batch size: 4096)"}}'
    assert too_long(500, raw) and runner_limit(raw, 8192) == 4096 and runner_limit(raw, 2048) == 2048
    ctx = b"input (1024 tokens) is larger than the max context size (512 tokens). skipping"
    assert too_long(400, ctx) and runner_limit(ctx, 4096) == 512
    assert not too_long(500, b"other") and runner_limit(b"other", 99) == 99
    assert "physical" not in too_long_message(0, 6000, 4096) + too_long_message(1, 6000, 4096, openai=True)


def test_openai_shapes_dimensions_and_base64() -> None:
    import base64
    import struct

    from trioshed.api.protocols.embeddings import openai_request, openai_response

    upstream, dimensions, encoding = openai_request({"model": "m", "input": ["a"], "dimensions": 2, "encoding_format": "base64", "user": "u"})
    assert upstream == {"model": "m", "input": ["a"], "encoding_format": "float"} and (dimensions, encoding) == (2, "base64")
    answer = {"data": [{"index": 0, "embedding": [3.0, 4.0, 12.0]}], "usage": {"prompt_tokens": 2, "total_tokens": 2}}
    out = openai_response(answer, "m", dimensions=2, encoding="base64")
    assert struct.unpack("<2f", base64.b64decode(out["data"][0]["embedding"])) == pytest.approx((0.6, 0.8))
    assert out["usage"] == {"prompt_tokens": 2, "total_tokens": 2} and out["model"] == "m"
    with pytest.raises(BadRequest, match="more than the model's 3"):
        openai_response(answer, "m", dimensions=4, encoding="float")
    with pytest.raises(BadRequest, match="encoding_format"):
        openai_request({"input": "a", "encoding_format": "int8"})
    with pytest.raises(BadRequest, match="at most 2048"):
        openai_request({"input": ["a"] * 2049})
