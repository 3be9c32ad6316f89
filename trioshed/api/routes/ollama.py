"""Ollama's generating routes: /api/generate and /api/chat.

Statuses are decided before the response starts (Quart sends headers before it enters the
body): unknown model 404, bad input 400, queue full 503, cannot fit 507, load failure 500, and
what the runner refuses before the first byte of its answer. Errors after the first streamed
chunk arrive as a final NDJSON ``{"error": ...}`` line.
The request building and stream translation are :mod:`trioshed.api.protocols.ollama`'s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Literal

from quart import Blueprint, Response

from trioshed.api.pipeline.preamble import (
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
    truncated,
)
from trioshed.api.protocols import ollama, sampling
from trioshed.api.protocols.llama import Upstream
from trioshed.api.protocols.ollama_stream import OllamaStream, ndjson
from trioshed.api.protocols.options import split_options
from trioshed.errors import TrioshedError
from trioshed.models.ollama_store import OllamaManifest
from trioshed.scheduler import Lease
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)
bp = Blueprint("ollama", __name__)

NDJSON = "application/x-ndjson"


async def _ollama_stream(lease: Lease, upstream: Upstream, stream: OllamaStream, started: float) -> AsyncIterator[bytes]:
    # Once upstream reported the end, only its usage/timings and the close follow (microseconds
    # later): what is left goes out in one write with the done chunk (one send fewer per answer),
    # the answer's Last piece, before the runner's connection is given back and the lease released.
    held = b""
    sent = False
    try:
        async with open_upstream(lease, upstream.path, upstream.body) as batches:
            async for lines in batches:
                out = stream.feed_lines_bytes(lines)
                if stream.finished:
                    held += out
                elif out:
                    sent = True
                    yield out
            if stream.finished:
                last = stream.finish(load_duration_ns=_ns(lease.load_duration), total_duration_ns=_ns(time.monotonic() - started))
                if stream.kind == "generate":
                    last["context"] = ollama.NO_CONTEXT
                if (trace := current_trace.get()) is not None:
                    trace.counted(last, stream.timings)
                yield Last(held + ndjson(last))
        if not stream.finished:
            raise await truncated(lease)
    except TrioshedError as exc:
        if not sent and not held:
            raise  # nothing of the answer yet: the request's error, with its status
        log.warning("stream for %s ended with an error: %s", lease.model.name, exc.message)
        yield held + ndjson(exc.to_json())
    finally:
        if not stream.finished and (trace := current_trace.get()) is not None:
            trace.counted(stream.so_far(), stream.timings)  # a stream the client left: what it got


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def _serve(kind: ollama.Kind) -> Response:
    st = state()
    started = time.monotonic()
    body = await read_body()
    req = prepare(body, body.get("model") or "")
    model, options, keep_alive = req.model, req.options, req.keep_alive
    await require_capabilities(model, body.get("model") or "", ollama.needs(kind, body), action=kind)

    if ollama.is_load_only(kind, body):
        reason: Literal["load", "unload"] = "load"
        if keep_alive == 0:
            await st.scheduler.unload(model)
            reason = "unload"
        else:
            async with st.scheduler.acquire(model, options, keep_alive, key=req.key):
                pass
        return Response(
            json.dumps(ollama.load_response(kind, model.name, done_reason=reason, created_at=ollama.now_rfc3339())),
            content_type="application/json",
        )

    preamble = model.origin.messages if isinstance(model.origin, OllamaManifest) else ()
    body = ollama.with_model_system(kind, body, model.system, preamble)
    templated = await has_chat_template(model)
    if kind == "generate":
        # A model without a chat template gets the prompt as it is (Ollama's default template
        # "{{ .Prompt }}"); llama-server would otherwise wrap it in ChatML.
        upstream = ollama.generate_upstream(body, chat_template=templated)
    elif templated:
        upstream = ollama.chat_upstream(body)
    else:
        upstream = ollama.transcript_upstream(body, default_stop=req.defaults.get("stop"))
    # under the request's options: the model's, then Ollama's DefaultOptions (not llama-server's)
    upstream = upstream.with_defaults({**sampling.OLLAMA, **split_options(req.defaults)[0]})
    top = body.get("top_logprobs")
    translator = OllamaStream(kind, model.name, prefill=upstream.prefill, top_logprobs=top if isinstance(top, int) else 0)

    fit = prompt_fit(req, upstream.path, upstream.body)
    if body.get("stream", True) is False:
        # One JSON answer upstream too: llama-server sends no per-token events to parse.
        whole = {k: v for k, v in upstream.body.items() if k != "stream_options"} | {"stream": False}
        async with st.scheduler.acquire(model, options, keep_alive, key=req.key, fit=fit) as lease:
            translator.feed(await post_upstream(lease, upstream.path, whole))
            if not translator.finished:
                raise await truncated(lease)
            result = translator.aggregate(
                load_duration_ns=_ns(lease.load_duration), total_duration_ns=_ns(time.monotonic() - started)
            )
        if kind == "generate":
            result["context"] = ollama.NO_CONTEXT
        if (trace := current_trace.get()) is not None:
            trace.counted(result, translator.timings)
        return Response(json.dumps(result, ensure_ascii=False), content_type="application/json")

    return await leased_stream(
        st.scheduler, model, options, keep_alive,
        lambda lease: _ollama_stream(lease, upstream, translator, started), NDJSON, key=req.key, fit=fit,
    )  # fmt: skip


@bp.post("/api/generate")
async def generate() -> Response:
    return await _serve("generate")


@bp.post("/api/chat")
async def chat() -> Response:
    return await _serve("chat")
