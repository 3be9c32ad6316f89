"""Embeddings: Ollama's /api/embed and /api/embeddings, OpenAI's /v1/embeddings.

They need a runner started with ``--embeddings`` (``RunnerOptions.embedding``); such a runner
generates too, so chat after embed does not reload, while embed after chat reloads once.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from quart import Blueprint, Response

from trioshed.api import translate
from trioshed.api.limits import check_embedding_input
from trioshed.api.ollama import json_body, keep_alive_of, state
from trioshed.api.openai import openai_request
from trioshed.api.upstream import post_upstream
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import BadRequest

bp = Blueprint("embed", __name__)


def _options(model: ModelSpec, body: dict[str, Any]) -> RunnerOptions:
    raw = body.get("options")
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest("options must be an object")
    _, runner = translate.split_options({**dict(model.defaults), **(raw or {})})
    return replace(state().runner_options(model, runner), embedding=True)


def _json(data: dict[str, Any]) -> Response:
    return Response(json.dumps(data), content_type="application/json")


@bp.post("/api/embed")
async def embed() -> Response:
    st = state()
    started = time.monotonic()
    body = await json_body()
    model = st.store.resolve(body.get("model") or "")
    keep_alive = keep_alive_of(body)
    options = _options(model, body)
    if translate.is_load_only("embed", body):
        async with st.scheduler.acquire(model, options, keep_alive):
            pass
        return _json({"model": model.name, "embeddings": []})
    upstream = translate.embed_upstream(body)
    async with st.scheduler.acquire(model, options, keep_alive) as lease:
        answer = await post_upstream(lease, upstream.path, upstream.body)
    return _json(
        translate.embed_response(
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
    body = await json_body()
    model = st.store.resolve(body.get("model") or "")
    upstream = translate.embeddings_upstream(body)
    async with st.scheduler.acquire(model, _options(model, body), keep_alive_of(body)) as lease:
        answer = await post_upstream(lease, upstream.path, upstream.body)
    return _json(translate.embeddings_response(answer))


@bp.post("/v1/embeddings")
async def openai_embeddings() -> Response:
    req = await openai_request(embedding=True)
    check_embedding_input(req.body.get("input"))
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive) as lease:
        answer = await post_upstream(lease, "/v1/embeddings", req.body)
    return _json(translate.openai_model_rewrite(answer, req.name))
