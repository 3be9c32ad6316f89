"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, /v1/models/{model}.

llama-server speaks OpenAI's API itself; trioshed resolves the model, leases a runner and
relays the answer, naming the model as the client did. Errors use OpenAI's error shape
(:mod:`trioshed.api.protocols.errors`); the translation is :mod:`trioshed.api.protocols.openai_chat`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import trio
from quart import Blueprint, Response

from trioshed.api.pipeline.preamble import (
    Prepared,
    has_chat_template,
    model_capabilities,
    prepare,
    read_body_raw,
    require_capabilities,
    state,
)
from trioshed.api.pipeline.prompt_count import prompt_fit
from trioshed.api.pipeline.upstream import (
    Last,
    client_status,
    leased_stream,
    open_upstream,
    open_upstream_bytes,
    post_upstream_raw,
)
from trioshed.api.protocols import sampling
from trioshed.api.protocols.errors import context_error, message_for, openai_error_event
from trioshed.api.protocols.openai_chat import (
    FINISHED,
    CompletionAsChat,
    LegacyLogprobs,
    ModelRenamer,
    as_chat,
    chat_needs,
    completion_logprobs_asked,
    logprobs_asked,
    openai_model_rewrite,
    transcript_completion_body,
    transcript_path,
    with_grammar_safe_schemas,
    with_response_format,
)
from trioshed.api.protocols.options import split_options
from trioshed.api.protocols.transcript import completion_event, completion_lines
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import BadRequest, ModelNotFound, TrioshedError
from trioshed.fleet import view as fleet_view
from trioshed.keys import ANONYMOUS, ApiKey, current_key
from trioshed.scheduler import Lease
from trioshed.trace import current as current_trace

bp = Blueprint("openai", __name__)


async def _relay(
    lease: Lease, path: str, body: dict[str, Any] | bytes, model: str, legacy: LegacyLogprobs | None = None
) -> AsyncIterator[bytes]:
    """llama-server's SSE bytes as they come, with ``model`` named as the client did (and, with
    ``legacy``, OpenAI's Completions logprobs fields added to each event)."""
    renamer = ModelRenamer(lease.model.name, model)
    fields = legacy.lines if legacy is not None else None
    # After the chunk with a finish reason only the usage chunk, [DONE] and the close follow
    # (microseconds later): they go out in one write with it (one or two sends fewer per answer).
    held = b""
    sent = False
    try:
        async with open_upstream_bytes(lease, path, body) as pieces:
            async for piece in pieces:
                out = renamer.feed(piece)
                if fields is not None and out:
                    out = fields(out)
                if held or FINISHED in out:
                    held += out
                elif out:
                    sent = True
                    yield out
            rest = renamer.finish()
            if fields is not None and rest:
                rest = fields(rest)
            if held and (trace := current_trace.get()) is not None:
                trace.counted_sse(held)  # the last events: usage (when asked) and llama-server's timings
            yield Last(held + rest)  # the answer's end, before the runner's connection goes back
    except TrioshedError as exc:
        if not sent and not held:
            raise  # nothing of the answer yet: the request's error, with its status
        yield held + openai_error_event(exc.status, message_for("/v1/chat/completions", exc))


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
    prepared: Prepared | None = None  # the preamble's answer (its need, output budget...)

    @property
    def key(self) -> ApiKey:
        """Whose request (the preamble read the gate's key)."""
        return self.prepared.key if self.prepared is not None else ANONYMOUS


async def openai_request(*, embedding: bool = False, need: Callable[[dict[str, Any]], int] | None = None) -> OpenAIRequest:
    """Parse an OpenAI-style body: model, and trioshed's extras ``keep_alive`` and ``options``.
    ``need``: the route's own count of the tokens the body takes in one slot (see ``prepare``)."""
    sent, body = await read_body_raw()
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required")
    req = prepare(body, name, embedding=embedding, need=need(body) if need is not None else None)
    raw: bytes | None = sent
    if "keep_alive" in body or "options" in body:
        raw = None
    body.pop("keep_alive", None)
    body.pop("options", None)
    return OpenAIRequest(body, name, req.model, req.options, req.keep_alive, raw, req)


def _sampled(req: OpenAIRequest) -> OpenAIRequest:
    """``req`` with the model's options and OpenAI's sampling defaults under the request's own
    (:mod:`trioshed.api.protocols.sampling`). A body that can go upstream as sent still does,
    with the added members written before the client's."""
    defaults = split_options(req.prepared.defaults)[0] if req.prepared is not None else {}
    extra = sampling.under(req.body, sampling.model_sampling_for_openai(defaults, req.body), sampling.OPENAI)
    if not extra:
        return req
    raw = None
    if req.raw is not None and not any(k in req.body for k in extra):  # a null member would be there twice
        raw = sampling.spliced(req.raw, extra)
    return replace(req, body={**req.body, **extra}, raw=raw)


async def _proxy(
    path: str, req: OpenAIRequest | None = None, *, as_chat_shape: bool = False, legacy: LegacyLogprobs | None = None
) -> Response:
    """Forward ``req`` (the request's body, parsed here when not given) to ``path``;
    ``as_chat_shape``: a /v1/completions answer is given in chat's shape (see :func:`_chat_as_transcript`)."""
    st = state()
    req = req or await openai_request()
    body, name, model, options, keep_alive = req.body, req.name, req.model, req.options, req.keep_alive
    streaming = bool(body.get("stream", False))
    upstream: dict[str, Any] | bytes = req.raw if req.raw is not None else {**body, "model": model.name}
    fit = prompt_fit(req.prepared, path, upstream) if req.prepared is not None else None
    if not streaming:
        async with st.scheduler.acquire(model, options, keep_alive, key=req.key, fit=fit) as lease:
            status, raw = await post_upstream_raw(lease, path, upstream)
        if status == 400 and (too_long := context_error(raw)) is not None:
            raise too_long
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"error": {"message": raw.decode("utf-8", "replace")[:500]}}
        if isinstance(data, dict):
            if as_chat_shape and status == 200:
                assert isinstance(upstream, dict)
                data = as_chat(completion_event(data) if path == "/completion" else data, top_logprobs=logprobs_asked(upstream))
            elif legacy is not None and status == 200:
                data = legacy.event(data)
            data = openai_model_rewrite(data, name)
            if (trace := current_trace.get()) is not None:
                trace.counted(data)
        return Response(json.dumps(data), status=client_status(status, raw), content_type="application/json")
    if as_chat_shape:
        assert isinstance(upstream, dict)
        relay = lambda lease: _relay_as_chat(lease, path, upstream, name)  # noqa: E731
    else:
        relay = lambda lease: _relay(lease, path, upstream, name, legacy)  # noqa: E731
    return await leased_stream(st.scheduler, model, options, keep_alive, relay, "text/event-stream", key=req.key, fit=fit)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    req = await openai_request()
    await require_capabilities(req.model, req.name, chat_needs(req.body), action="chat")
    if (safe := with_grammar_safe_schemas(req.body)) is not None:
        req = replace(req, body=safe, raw=None)
    req = _sampled(req)
    if not await has_chat_template(req.model):
        return await _chat_as_transcript(req)
    return await _proxy("/v1/chat/completions", req)


async def _chat_as_transcript(req: OpenAIRequest) -> Response:
    """Chat with a model that brings no chat template (a base model, like the demo's): the
    conversation as a plain transcript on llama-server's /v1/completions, cut at the next turn,
    answered in chat's shape. (llama-server's fallback, ChatML, makes such a model echo markup.)"""
    body = transcript_completion_body(req.body)
    return await _proxy(transcript_path(body), replace(req, body=body, raw=None), as_chat_shape=True)


async def _relay_as_chat(lease: Lease, path: str, body: dict[str, Any], model: str) -> AsyncIterator[bytes]:
    """llama-server's /v1/completions events (or /completion's, read in their shape) as
    chat.completion.chunk events."""
    options = body.get("stream_options")
    translator = CompletionAsChat(
        model, include_usage=isinstance(options, dict) and options.get("include_usage") is True, top_logprobs=logprobs_asked(body)
    )
    sent = False
    native = path == "/completion"
    try:
        async with open_upstream(lease, path, body) as batches:
            async for lines in batches:
                if out := translator.feed_lines(completion_lines(lines) if native else lines):
                    sent = True
                    yield out
            yield Last()  # the answer's end, before the runner's connection goes back
    except TrioshedError as exc:
        if not sent:
            raise  # nothing of the answer yet: the request's error, with its status
        yield openai_error_event(exc.status, message_for("/v1/chat/completions", exc))


@bp.post("/v1/completions")
async def completions() -> Response:
    req = await openai_request()
    await require_capabilities(req.model, req.name, (), action="generate")
    req = _sampled(req)
    if "response_format" in req.body:  # llama-server's completions honour only json_schema
        req = replace(req, body=with_response_format(req.body), raw=None)
    if completion_logprobs_asked(req.body):  # OpenAI's fields beside llama-server's own
        prompt = req.body.get("prompt")
        return await _proxy("/v1/completions", req, legacy=LegacyLogprobs(len(prompt) if isinstance(prompt, str) else 0))
    return await _proxy("/v1/completions", req)


async def _model_object(spec: ModelSpec) -> dict[str, Any]:
    """OpenAI's model object, with what the model can do (``/api/show``'s ``capabilities``, as
    llama.cpp's router lists them: ``rerank`` for a reranker)."""
    found = {"id": spec.short_name, "object": "model", "created": int(spec.modified or time.time()), "owned_by": "trioshed"}
    capabilities = await model_capabilities(spec)
    if capabilities is not None:
        found["capabilities"] = capabilities
    return found


@bp.get("/v1/models")
async def models() -> Any:
    st = state()
    specs = await trio.to_thread.run_sync(st.store.list)
    key = current_key.get()  # a key sees only the models it may use
    data = [await _model_object(s) for s in specs if key.may_use(s.name)]
    if st.fleet is not None:  # the fleet's models: those only other nodes hold
        elsewhere = fleet_view.models_elsewhere(st.fleet, {s.name for s in specs})
        data += [{"id": n.removesuffix(":latest"), "object": "model", "created": 0, "owned_by": "trioshed"} for n in sorted(elsewhere) if key.may_use(n)]
    return {"object": "list", "data": data}


@bp.get("/v1/models/<path:model>")
async def retrieve_model(model: str) -> Any:
    """One model (``openai`` ``models.retrieve``); names with a namespace (``user/m:tag``) too."""
    spec = await trio.to_thread.run_sync(state().store.resolve, model)
    if not current_key.get().may_use(spec.name):
        raise ModelNotFound(model)  # as for a model that does not exist
    return await _model_object(spec)
