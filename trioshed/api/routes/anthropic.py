"""Anthropic's Messages API: ``POST /v1/messages`` (whole and streamed) and ``/v1/messages/count_tokens``.

What Claude Code and the ``anthropic`` SDK speak. The translation is
:mod:`trioshed.api.protocols.anthropic` (requests) and :mod:`.protocols.anthropic_stream` (answers);
this module does the I/O: the shared preamble resolves the model and its runner options, a lease
on a runner carries the llama-server request, and the answer goes back as Anthropic's message or
event stream. Errors have Anthropic's shape (``protocols/errors.py`` chooses it by path), also as
the last event of a stream that fails after it started.

Upstream is always asked to stream: a whole answer is the stream aggregated, and a client's stop
sequence ends the generation where trioshed finds it (the relay stops reading; llama-server stops
a generation whose client left).

``count_tokens`` renders the conversation the way ``/v1/messages`` would send it (llama-server's
``/apply-template`` with the model's chat template and the tools, or the plain transcript for a
model without one) and counts it with the model's own tokenizer (``/tokenize``, with the special
tokens the prompt gets): the count equals the answer's ``input_tokens`` plus
``cache_read_input_tokens``. It needs the model's runner, as the tokenizer lives there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from quart import Blueprint, Response

from trioshed.api.pipeline.preamble import (
    Prepared,
    has_chat_template,
    prepare,
    read_body,
    require_capabilities,
    state,
)
from trioshed.api.pipeline.prompt_count import prompt_fit
from trioshed.api.pipeline.upstream import (
    Last,
    leased_stream,
    open_upstream,
    post_upstream,
    run_again_or_raise,
    truncated,
)
from trioshed.api.protocols import sampling
from trioshed.api.protocols.anthropic import (
    MessagesUpstream,
    count_tokens_upstream,
    messages_needs,
    messages_upstream,
)
from trioshed.api.protocols.anthropic_stream import MessageStream, encode_events, error_event
from trioshed.api.protocols.errors import message_for
from trioshed.api.protocols.options import split_options
from trioshed.api.protocols.transcript import with_turn_stop
from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, RunnerCrashed, RunnerStalled, TrioshedError, UpstreamError
from trioshed.models.capabilities import capabilities
from trioshed.scheduler import Lease
from trioshed.trace import current as current_trace

bp = Blueprint("anthropic", __name__)


async def _request(body: dict[str, Any]) -> tuple[str, Prepared, bool, bool]:
    """The model as the client named it, the preamble's result, whether the model has a chat
    template and whether it can think."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model: Field required (the name of a model trioshed serves)")
    prepared = prepare(body, name)
    templated = await has_chat_template(prepared.model)
    return name, prepared, templated, templated and await _can_think(prepared.model)


async def _can_think(spec: ModelSpec) -> bool:
    """Whether ``/api/show`` lists ``thinking`` for the model (its chat template has a thinking block)."""
    try:
        meta = await state().metadata(spec)
    except Exception:
        return False
    return "thinking" in capabilities(meta.fields, meta.chat_template or "", projector=bool(spec.projector))


def _with_defaults(up: MessagesUpstream, defaults: dict[str, Any]) -> MessagesUpstream:
    """The model's default sampling options, then Anthropic's (protocols/sampling.py), under the
    request's own; not the model's ``num_predict``, which llama-server would prefer to the
    client's ``max_tokens``. The model's ``stop`` applies when the request names no stop sequence
    (with a transcript's next turn, where there is one)."""
    model = {k: v for k, v in split_options(defaults)[0].items() if k != "n_predict"}
    upstream = up.upstream
    # the request's own stop sequences (matched here, or a transcript's beside its next turn)
    own = bool(up.stop_sequences) or (up.turn_stop is not None and upstream.body.get("stop") != [up.turn_stop])
    if own:
        model.pop("stop", None)  # replace the model's
    elif up.turn_stop is not None and "stop" in model:  # a transcript's next turn is a stop too
        upstream = replace(upstream, body={**upstream.body, "stop": with_turn_stop(model.pop("stop"))})
    upstream = upstream.with_defaults(sampling.under(upstream.body, model, sampling.ANTHROPIC))
    return MessagesUpstream(upstream, up.stop_sequences, up.turn_stop, up.prefill, up.stream)


def _translator(up: MessagesUpstream, name: str) -> MessageStream:
    return MessageStream(name, stop_sequences=up.stop_sequences, turn_stop=up.turn_stop, prefill=up.prefill)


@bp.post("/v1/messages")
async def messages() -> Response:
    st = state()
    body = await read_body()
    name, prepared, templated, can_think = await _request(body)
    model = prepared.model
    if model.system and not body.get("system"):
        body["system"] = model.system  # the store's SYSTEM, as the Ollama routes give it
    up = _with_defaults(messages_upstream(body, chat_template=templated, thinking_capable=can_think), prepared.defaults)
    await require_capabilities(model, name, messages_needs(body), action="chat")  # after the body's own checks
    fit = prompt_fit(prepared, up.upstream.path, up.upstream.body)
    if up.stream:
        return await leased_stream(st.scheduler, model, prepared.options, prepared.keep_alive,
                                   lambda lease: _relay(lease, up, name), "text/event-stream",
                                   key=prepared.key, fit=fit)  # fmt: skip
    async with st.scheduler.acquire(model, prepared.options, prepared.keep_alive, key=prepared.key, fit=fit) as lease:
        translator = await _whole(lease, up, name)
    message = translator.message()
    if (trace := current_trace.get()) is not None:
        trace.counted_anthropic(message["usage"])
    return Response(json.dumps(message, ensure_ascii=False), content_type="application/json")


async def _whole(lease: Lease, up: MessagesUpstream, name: str) -> MessageStream:
    """A whole answer, read from llama-server's stream: none of it reaches the client before its
    end, so the request waits for its answer until then (a runner that stops answering is
    found within seconds), and a runner that dies or hangs on the way costs a rerun on a new
    runner, as for any whole answer (once: :func:`~trioshed.api.pipeline.upstream.run_again_or_raise`)."""
    while True:
        translator = _translator(up, name)
        try:
            with lease.waiting_for_answer():
                async with open_upstream(lease, up.upstream.path, up.upstream.body) as batches:
                    async for lines in batches:
                        translator.feed_lines(lines)
                        if translator.cut:
                            break
            if not translator.finished:
                raise await truncated(lease)
            return translator
        except (RunnerCrashed, RunnerStalled) as exc:
            await run_again_or_raise(lease, exc)


async def _relay(lease: Lease, up: MessagesUpstream, name: str) -> AsyncIterator[bytes]:
    """llama-server's stream as Anthropic's events, one write per batch of upstream lines."""
    translator = _translator(up, name)
    trace = current_trace.get()
    sent = False
    try:
        async with open_upstream(lease, up.upstream.path, up.upstream.body) as batches:
            async for lines in batches:
                if events := translator.feed_lines(lines):
                    sent = True
                    yield encode_events(events)
                if translator.cut:
                    break  # a stop sequence: the runner's connection is closed right after the end
            if translator.finished:
                last = encode_events(translator.finish())
                if trace is not None:
                    trace.counted_anthropic(translator.usage())
                    trace = None  # counted: not again below
                yield Last(last)  # the answer's end, before the runner's connection goes back
        if not translator.finished:
            raise await truncated(lease)
    except TrioshedError as exc:
        if not sent:
            raise  # nothing of the answer yet: the request's error, with its status
        yield error_event(exc.status, message_for("/v1/messages", exc))
    finally:  # a stream the client left is counted too: what was generated so far
        if trace is not None:
            trace.counted_anthropic(translator.usage())


@bp.post("/v1/messages/count_tokens")
async def count_tokens() -> dict[str, int]:
    st = state()
    body = await read_body()
    _, prepared, templated, can_think = await _request(body)
    if prepared.model.system and not body.get("system"):
        body["system"] = prepared.model.system
    count = count_tokens_upstream(body, chat_template=templated, thinking_capable=can_think)
    async with st.scheduler.acquire(prepared.model, prepared.options, prepared.keep_alive, key=prepared.key) as lease:
        text = count.text
        if count.template is not None:
            rendered = await post_upstream(lease, "/apply-template", count.template)
            text = rendered.get("prompt")
            if not isinstance(text, str):
                raise UpstreamError("llama-server's /apply-template answered without a prompt")
        tokens = await post_upstream(lease, "/tokenize", {"content": text or "", "add_special": True, "parse_special": True})
    ids = tokens.get("tokens")
    if not isinstance(ids, list):
        raise UpstreamError("llama-server's /tokenize answered without tokens")
    return {"input_tokens": len(ids)}
