"""llama-server's routes beside chat, on trioshed's port: ``/infill`` (what editors call to
complete code), ``/tokenize``, ``/detokenize``, ``/apply-template``, each routed by its
``model`` field, and ``/upstream/<model>/<path>`` (llama-swap's convention) for the rest.

Every request is a lease like generate's: queued, counted, the keep-alive reset, the model
loaded first if needed. Bad input (no model, wrong types, a model without FIM tokens asked to
infill, a path that is not forwarded) is refused before anything loads. Answers are
llama-server's own, the model named as the client named it; errors have llama.cpp's shape
(:mod:`trioshed.api.protocols.errors`). The checks are :mod:`trioshed.api.protocols.llama_tools`'.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import trio
from quart import Blueprint, Response, request

from trioshed.api.pipeline.preamble import (
    Prepared,
    model_capabilities,
    prepare,
    read_body,
    read_body_raw,
    require_capabilities,
    state,
)
from trioshed.api.pipeline.upstream import (
    LeasedBody,
    client_status,
    open_upstream_bytes,
    post_upstream_raw,
    request_upstream,
)
from trioshed.api.protocols import llama_tools as protocol
from trioshed.api.protocols.errors import llama_error
from trioshed.api.protocols.openai_chat import ModelRenamer
from trioshed.api.protocols.options import split_options
from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, ModelNotFound, TrioshedError
from trioshed.scheduler import Lease

bp = Blueprint("tools", __name__)


def _model_name(body: Mapping[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest('"model" is required: the name of the model to use')
    return name


async def _prepare(body: Mapping[str, Any], name: str, need: int | None = None) -> Prepared:
    """The model and runner options; an embedding model's runner is started as embed starts it
    (its tokenizer is the same), so tokenizing does not reload it. ``need``: the tokens of
    context the request takes (None: its text's bound, as any request)."""
    req = prepare(body, name, need=need)
    has = await model_capabilities(req.model)
    if has is not None and "embedding" in has:
        req = prepare(body, name, embedding=True, need=need)
    return req


def _answer(status: int, raw: bytes, upstream_name: str, name: str) -> Response:
    """llama-server's answer as it came, but for the model named as the client did."""
    renamer = ModelRenamer(upstream_name, name)
    body = renamer.feed(raw) + renamer.finish()
    return Response(body, status=client_status(status, raw), content_type="application/json")


async def _relay(lease: Lease, path: str, body: dict[str, Any] | bytes, rename: str | None) -> AsyncGenerator[bytes, None]:
    """llama-server's stream as it comes (the model renamed to ``rename`` when given). First it
    yields ``b""`` once the runner answered 200, so that the route decides the status before the
    headers go out; an error after that ends the stream with llama-server's error event."""
    renamer = ModelRenamer(lease.model.name, rename) if rename is not None else None
    started = False
    try:
        async with open_upstream_bytes(lease, path, body) as pieces:
            started = True
            yield b""
            async for piece in pieces:
                if out := renamer.feed(piece) if renamer else piece:
                    yield out
        if renamer and (out := renamer.finish()):
            yield out
    except TrioshedError as exc:
        if not started:
            raise
        yield b"data: " + json.dumps(llama_error(exc.status, exc.message)).encode() + b"\n\n"


async def _stream(req: Prepared, path: str, body: dict[str, Any] | bytes, rename: str | None) -> Response:
    """Lease a runner, start the stream, and answer with it once llama-server said 200; its
    refusal (a context too small, ...) is the answer's status instead, the lease given back."""
    lease = await state().scheduler.wait_for_lease(req.model, req.options, req.keep_alive, key=req.key)
    pieces = _relay(lease, path, body, rename)
    try:
        await pieces.__anext__()
        response = Response(LeasedBody(lease, pieces), content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long streams
    except BaseException:
        with trio.CancelScope(shield=True):
            await pieces.aclose()
        lease.release()
        raise
    return response


async def _tool(path: str) -> Response:
    body = await read_body()
    name = _model_name(body)
    # tokenizing or rendering needs no context: the smallest automatic one, which any loaded
    # runner of the model serves (a 20,000-token prompt is counted without reloading the model)
    req = await _prepare(body, name, need=0 if path in protocol.CONTEXT_FREE else None)
    upstream = protocol.tool_body(path, body)
    if path == "/detokenize":
        await _check_vocabulary(req.model, upstream.get("tokens") or [])
    if path == "/infill":
        await require_capabilities(req.model, name, {"insert"}, action="generate")
        if req.defaults:  # the model's sampling defaults, under the request's own
            upstream = {**split_options(req.defaults)[0], **upstream}
        if protocol.infill_streams(upstream):
            return await _stream(req, path, upstream, name)
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key) as lease:
        status, raw = await post_upstream_raw(lease, path, upstream)
    return _answer(status, raw, req.model.name, name)


async def _check_vocabulary(spec: ModelSpec, tokens: list[int]) -> None:
    """Token ids outside the model's vocabulary are refused before anything loads (llama-server
    answers 500 for them)."""
    try:
        size = (await state().metadata(spec)).vocab_size
    except Exception:
        return  # unreadable here: let llama-server decide
    if size and tokens and max(tokens) >= size:
        raise BadRequest(f'"tokens" holds id {max(tokens)}, outside the model\'s vocabulary of {size} tokens (0 to {size - 1})')


@bp.post("/infill")
async def infill() -> Response:
    return await _tool("/infill")


@bp.post("/tokenize")
async def tokenize() -> Response:
    return await _tool("/tokenize")


@bp.post("/detokenize")
async def detokenize() -> Response:
    return await _tool("/detokenize")


@bp.post("/apply-template")
async def apply_template() -> Response:
    return await _tool("/apply-template")


# -- /upstream/<model>/<path> --------------------------------------------------------------------


def _resolve(rest: str) -> tuple[ModelSpec, str, str]:
    """The model, its name as given and the llama-server path of ``/upstream/<rest>`` (the first
    reading whose model exists; see :func:`protocol.split_upstream`)."""
    readings = protocol.split_upstream(rest, request.scope.get("raw_path") or b"")
    store = state().store
    first: TrioshedError | None = None
    for name, path in readings:
        try:
            return store.resolve(name), name, path
        except (ModelNotFound, BadRequest) as exc:  # not this reading (a name no store accepts is one)
            first = first or exc
    raise first or ModelNotFound(rest)


@bp.route("/upstream/<path:rest>", methods=["GET", "POST"])
async def upstream(rest: str) -> Response:
    _, name, path = _resolve(rest)
    method = request.method
    protocol.upstream_allowed(method, path)
    payload = b""
    streaming = False
    parsed: dict[str, Any] = {}
    if method == "POST":
        payload, parsed = await read_body_raw()
        streaming = parsed.get("stream") is True
    # the runner is leased with the model's own settings; a body's trioshed fields are ignored
    req = prepare({}, name, embedding=path in protocol.UPSTREAM_EMBEDDING)
    target = protocol.upstream_target(path, request.query_string)
    if streaming:
        return await _stream(req, target, payload, None)
    async with state().scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key) as lease:
        status, headers, raw = await request_upstream(lease, method, target, payload)
    if path == "/props" and status == 200:
        raw = protocol.scrub_props(raw, name)
    return Response(raw, status=status, content_type=headers.get("content-type", "application/json"))

