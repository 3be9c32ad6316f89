"""Embeddings: Ollama's /api/embed and /api/embeddings, OpenAI's /v1/embeddings.

They need a runner started with ``--embeddings`` (``RunnerOptions.embedding``); such a runner
generates too, so chat after embed does not reload, while embed after chat reloads once. Its
micro-batch is its whole context (``core.estimate_kv.batch_sizes``), so one input up to the
context is embedded as llama-server alone would; a longer one is cut (Ollama's ``truncate``,
the default) or refused with a 400 (``truncate: false``, and OpenAI's route), never passed on
as llama-server's own 500.
"""

from __future__ import annotations

import json
import time
from typing import Any

from quart import Blueprint, Response

from trioshed.api.pipeline.limits import check_embedding_input
from trioshed.api.pipeline.preamble import prepare, read_body, require_kind, state
from trioshed.api.pipeline.upstream import (
    client_status,
    json_answer,
    post_upstream,
    post_upstream_raw,
    upstream_message,
)
from trioshed.api.protocols import embeddings as protocol
from trioshed.api.protocols.ollama import is_load_only
from trioshed.api.protocols.openai_chat import ModelRenamer
from trioshed.api.routes.openai import openai_request
from trioshed.core.estimate_kv import batch_sizes
from trioshed.core.model import RunnerOptions
from trioshed.errors import BadRequest, UpstreamError
from trioshed.scheduler import Lease

bp = Blueprint("embed", __name__)


def _json(data: dict[str, Any]) -> Response:
    return Response(json.dumps(data), content_type="application/json")


def input_limit(options: RunnerOptions) -> int:
    """The most tokens one input may have on a runner of ``options``: its slot's context, which
    its micro-batch holds (:func:`trioshed.core.estimate_kv.batch_sizes`)."""
    return min(options.num_ctx, batch_sizes(options)[1])


async def _tokenize(lease: Lease, text: str, *, special: bool) -> list[int]:
    answer = await post_upstream(lease, "/tokenize", {"content": text, "add_special": special})
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        raise UpstreamError(f"llama-server sent an unexpected /tokenize answer: {str(answer)[:200]}")
    return [t if isinstance(t, int) else int(t["id"]) for t in tokens]


async def embed_within(
    lease: Lease, body: dict[str, Any], limit: int, *, truncate: bool, openai: bool = False
) -> bytes:
    """POST ``body`` (``input``: texts or token lists) to the runner's ``/v1/embeddings`` and
    return its answer as it came (OpenAI's route relays it without a JSON round trip: ~15 ms of
    trioshed's CPU for 32 vectors of 128 floats).

    An input over ``limit`` tokens costs nothing until llama-server refuses it: then each input
    is counted (the runner's ``/tokenize``), and those over the limit are cut to it
    (``truncate``) or refused with a 400 in the route's words.
    """
    status, raw = await post_upstream_raw(lease, "/v1/embeddings", body)
    if status == 200:
        return raw
    if not protocol.too_long(status, raw):
        raise UpstreamError(upstream_message(raw, status), status=client_status(status, raw))
    limit = protocol.runner_limit(raw, limit)
    inputs = body["input"]
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    inputs = list(inputs)
    counted = [await _tokenize(lease, x, special=True) if isinstance(x, str) else list(x) for x in inputs]
    over = [i for i, tokens in enumerate(counted) if len(tokens) > limit]
    if not over:
        raise UpstreamError(upstream_message(raw, status), status=client_status(status, raw))
    if not truncate or openai:
        i = over[0]
        raise BadRequest(protocol.too_long_message(i, len(counted[i]), limit, openai=openai))
    specials = await _tokenize(lease, "", special=True)
    for i in over:
        text = inputs[i]
        plain = await _tokenize(lease, text, special=False) if isinstance(text, str) else counted[i]
        inputs[i] = protocol.truncated_tokens(counted[i], plain, specials, limit)
    status, raw = await post_upstream_raw(lease, "/v1/embeddings", {**body, "input": inputs})
    if status != 200:
        raise UpstreamError(upstream_message(raw, status), status=client_status(status, raw))
    return raw


def _truncate(body: dict[str, Any]) -> bool:
    value = body.get("truncate", True)
    if not isinstance(value, bool):
        raise BadRequest('"truncate" must be true or false')
    return value


@bp.post("/api/embed")
async def embed() -> Response:
    st = state()
    started = time.monotonic()
    body = await read_body()
    req = prepare(body, body.get("model") or "", embedding=True, need=protocol.input_need(body.get("input")))
    model, options, keep_alive = req.model, req.options, req.keep_alive
    await require_kind(model, body.get("model") or "", "embedding")
    if is_load_only("embed", body):
        async with st.scheduler.acquire(model, options, keep_alive, key=req.key):
            pass
        return _json({"model": model.name, "embeddings": []})
    upstream = protocol.embed_upstream(body)
    truncate = _truncate(body)
    async with st.scheduler.acquire(model, options, keep_alive, key=req.key) as lease:
        answer = json_answer(await embed_within(lease, upstream.body, input_limit(options), truncate=truncate))
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
    req = prepare(body, body.get("model") or "", embedding=True, need=protocol.input_need(body.get("prompt")))
    await require_kind(req.model, body.get("model") or "", "embedding")
    upstream = protocol.embeddings_upstream(body)
    async with st.scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key) as lease:
        answer = json_answer(await embed_within(lease, upstream.body, input_limit(req.options), truncate=True))
    return _json(protocol.embeddings_response(answer))


@bp.post("/v1/embeddings")
async def openai_embeddings() -> Response:
    req = await openai_request(embedding=True, need=lambda body: protocol.input_need(body.get("input")))
    check_embedding_input(req.body.get("input"))
    await require_kind(req.model, req.name, "embedding")
    upstream, dimensions, encoding = protocol.openai_request(req.body)
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key) as lease:
        raw = await embed_within(lease, upstream, input_limit(req.options), truncate=False, openai=True)
        upstream_name = lease.model.name
    if dimensions is None and encoding == "float":  # llama-server's answer as it is, renamed
        renamer = ModelRenamer(upstream_name, req.name)
        return Response(renamer.feed(raw) + renamer.finish(), content_type="application/json")
    return _json(protocol.openai_response(json_answer(raw), req.name, dimensions=dimensions, encoding=encoding))
