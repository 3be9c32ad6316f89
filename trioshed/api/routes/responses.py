"""OpenAI's Responses API: ``POST /v1/responses`` (stateless: nothing is stored).

The request becomes a chat completion (:mod:`trioshed.api.protocols.openai_responses`) on the
model's chat template, or a plain transcript for a model without one, as ``/v1/chat/completions``
does; the answer comes back as a Response object or as Responses events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

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
    client_status,
    leased_stream,
    open_upstream,
    post_upstream_raw,
    truncated,
    upstream_message,
)
from trioshed.api.protocols import sampling
from trioshed.api.protocols.errors import context_error, message_for, openai_error
from trioshed.api.protocols.llama import parse_sse_line, upstream_error_message
from trioshed.api.protocols.openai_chat import (
    chat_needs,
    transcript_completion_body,
    transcript_path,
)
from trioshed.api.protocols.openai_responses import Response as Frame
from trioshed.api.protocols.openai_responses import ResponsesStream, chat_request, response_of
from trioshed.api.protocols.options import split_options
from trioshed.api.protocols.transcript import completion_event
from trioshed.errors import BadRequest, TrioshedError, UpstreamError
from trioshed.scheduler import Lease
from trioshed.trace import current as current_trace

bp = Blueprint("responses", __name__)


@bp.post("/v1/responses")
async def responses() -> Response:
    body = await read_body()
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required")
    chat = chat_request(body)  # before the model: previous_response_id is refused for any model
    req = prepare(body, name)
    await require_capabilities(req.model, name, chat_needs(chat), action="chat")
    # under the request's own: the model's options, then OpenAI's defaults (protocols/sampling.py)
    model_sampling = sampling.model_sampling_for_openai(split_options(req.defaults)[0], chat)
    chat |= sampling.under(chat, model_sampling, sampling.OPENAI)
    path = "/v1/chat/completions"
    if not await has_chat_template(req.model):
        chat = transcript_completion_body(chat)
        path = transcript_path(chat)  # /completion for images and sounds, read as /v1/completions
    st = state()
    frame = Frame(body, name, int(time.time()))
    fit = prompt_fit(req, path, chat)
    if body.get("stream") is not True:
        whole = {**chat, "model": req.model.name, "stream": False}
        async with st.scheduler.acquire(req.model, req.options, req.keep_alive, key=req.key, fit=fit) as lease:
            status, raw = await post_upstream_raw(lease, path, whole)
        if status == 400 and (too_long := context_error(raw)) is not None:
            raise too_long
        if status != 200:
            code = client_status(status, raw)
            return _json(openai_error(code, upstream_message(raw, status)), code)
        answer = json.loads(raw)
        if path == "/completion":
            answer = completion_event(answer)
        if (trace := current_trace.get()) is not None:
            trace.counted(answer)
        return _json(response_of(frame, answer, int(time.time())))
    upstream = {**chat, "model": req.model.name, "stream": True, "stream_options": {"include_usage": True}}
    stream = ResponsesStream(frame)
    return await leased_stream(
        st.scheduler, req.model, req.options, req.keep_alive,
        lambda lease: _relay(lease, path, upstream, stream), "text/event-stream", key=req.key, fit=fit,
    )  # fmt: skip


def _json(data: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(data, ensure_ascii=False), status=status, content_type="application/json")


async def _relay(lease: Lease, path: str, body: dict[str, Any], stream: ResponsesStream) -> AsyncIterator[bytes]:
    """llama-server's stream as Responses events. The response starts (``response.created``)
    with the answer's first byte: an error before it is the request's, with its status."""
    trace = current_trace.get()
    started = False
    native = path == "/completion"
    try:
        async with open_upstream(lease, path, body) as batches:
            async for lines in batches:
                events = []
                for line in lines:
                    event = parse_sse_line(line)
                    if event is None:
                        continue
                    if native:
                        event = completion_event(event)
                    if "error" in event:
                        raise UpstreamError(f"llama-server error: {upstream_error_message(event)}")
                    if trace is not None and ("usage" in event or "timings" in event):
                        trace.counted(event)  # the usage chunk and llama-server's timings, at the end
                    events.append(event)
                out = b""
                if not started:  # the response's first events first: they take the first sequence numbers
                    started, out = True, stream.start()
                for event in events:
                    out += stream.feed(event)
                if out:
                    yield out
            if stream.finished:  # the answer's end, before the runner's connection goes back
                yield Last((b"" if started else stream.start()) + stream.finish(int(time.time())))
                started = True
        if not stream.finished:
            raise await truncated(lease)
    except TrioshedError as exc:
        if not started:
            raise
        yield stream.failed("server_error", message_for("/v1/responses", exc))
