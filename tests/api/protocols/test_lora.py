"""The per-request ``lora`` list in llama-server's bodies (:mod:`trioshed.api.protocols.lora`)."""

from __future__ import annotations

import json

import pytest

from trioshed.api.protocols.lora import with_lora
from trioshed.errors import BadRequest

LORA = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions", "/infill", "/completion?x=1"])
def test_the_list_replaces_the_client_s_on_every_path_that_honours_it(path: str) -> None:
    body = {"prompt": "hi", "lora": [{"id": 0, "scale": 1.0}]}
    assert with_lora(path, body, LORA, selects=True) == {"prompt": "hi", "lora": LORA}
    raw = with_lora(path, json.dumps(body).encode(), LORA, selects=True)
    assert isinstance(raw, bytes) and json.loads(raw) == {"prompt": "hi", "lora": LORA}


def test_nothing_changes_without_adapters_or_where_none_is_involved() -> None:
    body = {"prompt": "hi"}
    assert with_lora("/completion", body, None, selects=False) is body
    assert with_lora("/tokenize", body, LORA, selects=True) is body
    assert with_lora("/completion", b"not json", LORA, selects=True) == b"not json"  # llama-server says what is wrong
    assert with_lora("/completion", b"[1]", LORA, selects=True) == b"[1]"
    # a runner with fixed adapters (embeddings): its global scales are the model's own
    assert with_lora("/v1/embeddings", body, LORA, selects=False) is body


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/embedding", "/v1/embeddings", "/v1/rerank"])
def test_a_path_that_ignores_the_list_is_refused_on_a_runner_that_selects(path: str) -> None:
    with pytest.raises(BadRequest, match="cannot select"):
        with_lora(path, {"messages": []}, LORA, selects=True)
