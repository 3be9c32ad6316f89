"""Embeddings: Ollama's /api/embed and /api/embeddings, OpenAI's /v1/embeddings.

They need a runner started with ``--embeddings`` (``RunnerOptions.embedding``); such a runner
generates too, so chat after embed does not reload, while embed after chat reloads once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from quart import Blueprint, Response

from trioshed.api.limits import check_embedding_input
from trioshed.api.openai import openai_request
from trioshed.api.preamble import prepare, read_body, state
from trioshed.api.protocols import embeddings as protocol
from trioshed.api.protocols.ollama import is_load_only
from trioshed.api.protocols.openai_chat import openai_model_rewrite
from trioshed.api.upstream import post_upstream

bp = Blueprint("embed", __name__)


def _json(data: dict[str, Any]) -> Response:
    return Response(json.dumps(data), content_type="application/json")


@bp.post("/api/embed")
async def embed() -> Response:
    st = state()
    started = time.monotonic()
    body = await read_body()
    req = prepare(body, body.get("model") or "", embedding=True)
    model, options, keep_alive = req.model, req.options, req.keep_alive
    if is_load_only("embed", body):
        async with st.scheduler.acquire(model, options, keep_alive):
            pass
        return _json({"model": model.name, "embeddings": []})
    upstream = protocol.embed_upstream(body)
    async with st.scheduler.acquire(model, options, keep_alive) as lease:
        answer = await post_upstream(lease, upstream.path, upstream.body)
    return _json(
        protocol.embed_response(
            answer,
            model.name,
            dimensions=body.get("dimensions"),
            load_duration_ns=int(lease.load_duration * 1e9),
            total_duration_ns=int((time.monotonic() - started) * 1e9),
        )
    )


@bp.post("/api/embeddings")
async def embeddings() -> Response:
    st = state()
    body = await read_body()
    req = prepare(body, body.get("model") or "", embedding=True)
    upstream = protocol.embeddings_upstream(body)
    async with st.scheduler.acquire(req.model, req.options, req.keep_alive) as lease:
        answer = await post_upstream(lease, upstream.path, upstream.body)
    return _json(protocol.embeddings_response(answer))


@bp.post("/v1/embeddings")
async def openai_embeddings() -> Response:
    req = await openai_request(embedding=True)
    check_embedding_input(req.body.get("input"))
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive) as lease:
        answer = await post_upstream(lease, "/v1/embeddings", req.body)
    return _json(openai_model_rewrite(answer, req.name))
