"""``POST /v1/audio/transcriptions``: OpenAI's speech-to-text route, answered by a model that
hears (a projector with an audio encoder) through a chat turn on its runner. The request's shape
and the answer's are :mod:`trioshed.api.protocols.transcription`'s; a model that cannot hear
gets OpenAI's error shape with Ollama's words (``"m" does not support audio``)."""

from __future__ import annotations

import json
from typing import Any

from quart import Blueprint, Response, request

from trioshed.api.pipeline.preamble import prepare, require_capabilities, state
from trioshed.api.pipeline.upstream import client_status, post_upstream_raw, upstream_message
from trioshed.api.protocols.errors import context_error
from trioshed.api.protocols.transcription import parse_transcription, transcript_answer
from trioshed.errors import BadRequest, UnsupportedMediaType, UpstreamError

bp = Blueprint("transcriptions", __name__)


@bp.post("/v1/audio/transcriptions")
async def transcriptions() -> Response:
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise UnsupportedMediaType("send the audio as multipart/form-data (fields file, model, ...), as OpenAI's SDKs do")
    form = await request.form
    files = await request.files
    upload = files.get("file")
    asked = parse_transcription({k: str(v) for k, v in form.items()}, upload.read() if upload is not None else None)
    prepared = prepare({}, asked.model)
    await require_capabilities(prepared.model, asked.model, ("audio",), action="chat")
    st = state()
    async with st.scheduler.acquire(prepared.model, prepared.options, prepared.keep_alive, key=prepared.key) as lease:
        status, raw = await post_upstream_raw(lease, "/v1/chat/completions", {**asked.chat_body(), "model": prepared.model.name})
    if status != 200:
        if status == 400 and (too_long := context_error(raw)) is not None:
            raise too_long
        raise UpstreamError(upstream_message(raw, status), status=client_status(status, raw))
    try:
        chat: Any = json.loads(raw)
    except ValueError:
        raise UpstreamError("llama-server's answer was not JSON") from None
    if not isinstance(chat, dict):
        raise BadRequest("llama-server's answer was not a JSON object")
    body, content_type = transcript_answer(asked, chat)
    return Response(body, status=200, content_type=content_type)
