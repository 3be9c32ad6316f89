"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, /v1/models/{model}.

llama-server speaks OpenAI's API itself; trioshed resolves the model, leases a runner and
relays the answer, naming the model as the client did. Errors use OpenAI's error shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import trio
from quart import Blueprint, Response

from trioshed.api.ollama import json_body_raw, keep_alive_of, state
from trioshed.api.translate import ModelRenamer, openai_model_rewrite, split_options
from trioshed.api.upstream import (
    client_status,
    leased_stream,
    open_upstream_bytes,
    post_upstream_raw,
)
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import BadRequest, TrioshedError
from trioshed.scheduler import Lease
from trioshed.trace import current as current_trace

bp = Blueprint("openai", __name__)


async def _relay(lease: Lease, path: str, body: dict[str, Any] | bytes, model: str) -> AsyncIterator[bytes]:
    """llama-server's SSE bytes as they come, with ``model`` named as the client did."""
    renamer = ModelRenamer(lease.model.name, model)
    # After the chunk with a finish reason only the usage chunk, [DONE] and the close follow
    # (microseconds later): they go out in one write with it (one or two sends fewer per answer).
    held = b""
    try:
        async with open_upstream_bytes(lease, path, body) as pieces:
            async for piece in pieces:
                out = renamer.feed(piece)
                if held or _FINISHED in out:
                    held += out
                elif out:
                    yield out
        if out := held + renamer.finish():
            yield out
    except TrioshedError as exc:
        yield held + b"data: " + json.dumps({"error": {"message": exc.message, "type": "server_error", "code": exc.status}}).encode() + b"\n\n"


_FINISHED = b'"finish_reason":"'  # a non-null finish reason, as llama-server serializes it


@dataclass
class OpenAIRequest:
    body: dict[str, Any]  # what goes upstream: trioshed's own fields removed
    name: str  # the model as the client named it (answers name it so too)
    model: ModelSpec
    options: RunnerOptions
    keep_alive: float | None
    #: The body as the client sent it, when it can go upstream unchanged (no trioshed extras;
    #: llama-server ignores ``model`` and names its alias, which the relay renames).
    raw: bytes | None = None


async def openai_request(*, embedding: bool = False) -> OpenAIRequest:
    """Parse an OpenAI-style body: model, and trioshed's extras ``keep_alive`` and ``options``."""
    st = state()
    sent, body = await json_body_raw()
    raw: bytes | None = sent
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required")
    model = st.store.resolve(name)
    keep_alive = keep_alive_of(body)
    if "keep_alive" in body or "options" in body:
        raw = None
    body.pop("keep_alive", None)
    overrides = body.pop("options", None) or {}
    if not isinstance(overrides, dict):
        raise BadRequest("options must be an object")
    options = st.runner_options(model, split_options({**dict(model.defaults), **overrides})[1])
    if embedding:
        options = replace(options, embedding=True)
    return OpenAIRequest(body, name, model, options, keep_alive, raw)


async def _proxy(path: str) -> Response:
    st = state()
    req = await openai_request()
    body, name, model, options, keep_alive = req.body, req.name, req.model, req.options, req.keep_alive
    streaming = bool(body.get("stream", False))
    upstream: dict[str, Any] | bytes = req.raw if req.raw is not None else {**body, "model": model.name}
    if not streaming:
        async with st.scheduler.acquire(model, options, keep_alive) as lease:
            status, raw = await post_upstream_raw(lease, path, upstream)
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"error": {"message": raw.decode("utf-8", "replace")[:500]}}
        if isinstance(data, dict):
            data = openai_model_rewrite(data, name)
            if (trace := current_trace.get()) is not None:
                trace.counted(data)
        return Response(json.dumps(data), status=client_status(status, raw), content_type="application/json")
    return await leased_stream(
        st.scheduler, model, options, keep_alive, lambda lease: _relay(lease, path, upstream, name), "text/event-stream"
    )


@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    return await _proxy("/v1/chat/completions")


@bp.post("/v1/completions")
async def completions() -> Response:
    return await _proxy("/v1/completions")


def _model_object(spec: ModelSpec) -> dict[str, Any]:
    return {"id": spec.short_name, "object": "model", "created": int(spec.modified or time.time()), "owned_by": "trioshed"}


@bp.get("/v1/models")
async def models() -> Any:
    st = state()
    specs = await trio.to_thread.run_sync(st.store.list)
    return {"object": "list", "data": [_model_object(s) for s in specs]}


@bp.get("/v1/models/<path:model>")
async def retrieve_model(model: str) -> Any:
    """One model (``openai`` ``models.retrieve``); names with a namespace (``user/m:tag``) too."""
    spec = await trio.to_thread.run_sync(state().store.resolve, model)
    return _model_object(spec)
