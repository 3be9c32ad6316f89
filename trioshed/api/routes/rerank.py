"""Rerank: ``POST /v1/rerank`` with llama.cpp's aliases ``/rerank`` and ``/v1/reranking``, and
Cohere v2's ``/v2/rerank`` (Cohere v1 and Jina clients post to ``/v1/rerank``).

A reranker (rank pooling or a classifier head in its GGUF) runs with ``--rerank``
(``runner.command``), scheduled, fitted, kept alive and evicted like any model. The body is
checked, and a model that is no reranker refused, before any runner is leased; shapes are
:mod:`trioshed.api.protocols.rerank`'s.
"""

from __future__ import annotations

import json
import uuid

from quart import Blueprint, Response

from trioshed.api.pipeline.preamble import prepare, read_body, require_kind, state
from trioshed.api.pipeline.upstream import client_status, post_upstream_raw, upstream_message
from trioshed.api.protocols import rerank as protocol
from trioshed.api.protocols.embeddings import runner_limit
from trioshed.api.routes.embed import input_limit
from trioshed.errors import BadRequest, UpstreamError

bp = Blueprint("rerank", __name__)

ROUTES = ("/v1/rerank", "/rerank", "/v1/reranking", "/v2/rerank")


async def rerank() -> Response:
    body = await read_body()
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest('"model" is required: the name of a reranker')
    parsed = protocol.parse(body)
    req = prepare(body, name, embedding=True, need=protocol.need(parsed))
    await require_kind(req.model, name, "rerank")
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key) as lease:
        status, raw = await post_upstream_raw(lease, "/v1/rerank", protocol.upstream_body(parsed))
    if status != 200:
        tokens = protocol.too_long(status, raw)
        if tokens is not None:
            limit = runner_limit(raw, input_limit(req.options))
            raise BadRequest(protocol.too_long_message(tokens, limit))
        raise UpstreamError(upstream_message(raw, status), status=client_status(status, raw))
    try:
        answer = json.loads(raw)
    except ValueError:
        raise UpstreamError(f"llama-server answered with invalid JSON: {raw[:200]!r}") from None
    if not isinstance(answer, dict):
        raise UpstreamError("llama-server answered with something other than a JSON object")
    result = protocol.response(answer, parsed, name, f"rerank-{uuid.uuid4().hex}")
    return Response(json.dumps(result), content_type="application/json")


for _path in ROUTES:
    bp.add_url_rule(_path, f"rerank{_path.replace('/', '_')}", rerank, methods=["POST"])
