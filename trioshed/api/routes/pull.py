"""``POST /api/pull``: Ollama's pull, streamed as Ollama streams it (see :mod:`trioshed.models.pull`).

The manifest is fetched and checked before the answer starts, so that a name the registry does
not know is a 404, a bad name a 400, a full disk a 507, an unreachable registry a 502, and every
folder being a read-only Ollama store a 403. Then, with ``stream`` (the default), NDJSON progress
lines (``pulling manifest``, ``pulling <12 hex>`` with ``digest``/``total``/``completed``,
``verifying sha256 digest``, ``writing manifest``, ``success``); a failure after that is a last
``{"error": ...}`` line, as Ollama sends it. With ``"stream": false`` the answer is the last line
(``{"status": "success"}``) or the error with its status.

Cancellation: a client that goes away cancels its pull; a partial download stays for the next
pull to resume (or for another pull following it to take over).
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

from quart import Blueprint, Response

from trioshed.api.pipeline.preamble import read_body, store_writer
from trioshed.api.routes.manage import progress_body
from trioshed.errors import BadRequest

log = logging.getLogger(__name__)
bp = Blueprint("pull", __name__)
NDJSON = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


@bp.post("/api/pull")
async def pull() -> Response:
    st = store_writer()
    body = await read_body()
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest('"model" is required')
    insecure = body.get("insecure", False)
    stream = body.get("stream", True)
    if not isinstance(insecure, bool) or not isinstance(stream, bool):
        raise BadRequest('"insecure" and "stream" must be true or false')
    puller = st.puller()
    prepared = await puller.prepare(name, insecure=insecure)
    lines = st.writer.start(partial(puller.run, prepared))
    if not stream:
        async with lines:
            async for _ in lines:
                pass
        return Response(json.dumps({"status": "success"}), content_type="application/json")
    response = Response(progress_body(lines, f"pull of {prepared.plan.target.display}"), content_type=NDJSON)
    response.timeout = None  # a pull of gigabytes outlasts Quart's 60 s RESPONSE_TIMEOUT
    return response
