"""Ollama's model-management routes: blobs, create, copy, delete, push (pull is :mod:`trioshed.api.routes.pull`).

* ``HEAD /api/blobs/sha256:<hex>``: 200 when the blob is in trioshed's store (``pulled/``), 404
  when not. ``POST``: the upload, served as plain ASGI by :mod:`trioshed.api.routes.upload` (in
  constant memory), streamed to a partial file while it is hashed, renamed into place only when
  its sha256 matches (201; 200 when it was there already; 400 on a mismatch, nothing kept; 413
  above 2 TiB; 507 when the disk has no room). See :mod:`trioshed.models.blobs`.
* ``POST /api/create``: Ollama's fields (``model``, ``from``, ``files``, ``adapters``,
  ``template``, ``system``, ``license``, ``parameters``, ``messages``, ``quantize``) or the older
  ``modelfile`` text; checked whole before the answer starts (400/403/404/501), then streamed
  (``using existing layer …``, ``creating new layer …``, ``writing manifest``, ``success``) or,
  with ``"stream": false``, the last line. See :mod:`trioshed.models.create`.
* ``DELETE /api/delete``: a model of trioshed's own folder store is unloaded (unless another
  name still serves its file), then its GGUF file (or its ``models.toml`` name) removed; a
  pulled or created model's manifest is removed with the blobs no other manifest names; a model
  of an Ollama store is 403 (read-only).
* ``POST /api/copy``: a pulled or created model gets a second manifest (the blobs are shared);
  a folder-store model a ``models.toml`` entry ``destination`` naming the source's files.
* ``POST /api/push``: a pulled or created model sent to an Ollama-protocol registry, checked
  before the answer starts (400 bad name, 404 not here), then streamed as Ollama streams it
  (``retrieving manifest``, ``pushing <12 hex>``, ``pushing manifest``, ``success``); a failure
  after that is a last ``{"error": …}`` line. See :mod:`trioshed.models.push`.

Every route here that writes goes through :func:`~trioshed.api.pipeline.preamble.store_writer`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, request

from trioshed.api.pipeline.preamble import read_body, state, store_writer
from trioshed.api.protocols.errors import ollama_error
from trioshed.errors import BadRequest, NotSupported, TrioshedError
from trioshed.models.blobs import has_blob
from trioshed.models.writer import Lines

log = logging.getLogger(__name__)
bp = Blueprint("manage", __name__)
NDJSON = "application/x-ndjson"

HOW_TO_ADD = (
    "to add a model, pull it (trioshed pull NAME, or /api/pull), create it (trioshed create NAME -f Modelfile), copy its "
    "GGUF file into the model store (TRIOSHED_MODELS; NAME.gguf is model NAME), or point TRIOSHED_MODELS at an existing "
    "Ollama store (e.g. ~/.ollama/models, several folders separated by ':')"
)


def _name(body: dict[str, object], *keys: str) -> str:
    for key in keys:
        value = body.get(key)
        if isinstance(value, str) and value.strip():
            return value
    raise BadRequest(f'"{keys[0]}" is required')


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


@bp.delete("/api/delete")
async def delete() -> Response:
    st = store_writer()
    body = await read_body()
    name = _name(body, "model", "name")
    spec = await trio.to_thread.run_sync(st.store.find_for_delete, name)
    if not await trio.to_thread.run_sync(st.store.shares_file, spec):
        await st.scheduler.unload(spec)  # waits until its runners have exited
    await st.writer.change(lambda claimed: st.store.delete(name, protect=claimed))
    return Response("", status=200)


@bp.post("/api/copy")
async def copy() -> Response:
    st = store_writer()
    body = await read_body()
    source = _name(body, "source")
    destination = _name(body, "destination")
    await st.writer.change(lambda _: st.store.copy(source, destination))
    return Response("", status=200)


@bp.route("/api/blobs/<digest>", methods=["HEAD", "POST"])
async def blobs(digest: str) -> Response:
    """``HEAD``. ``POST`` (the upload) is served as plain ASGI before Quart sees it
    (:mod:`trioshed.api.routes.upload`: Quart would hold the whole body in memory); it is routed here
    too so that Quart answers a refused upload (the gate's 401/403/429) as it answers any route."""
    if request.method != "HEAD":
        raise NotSupported("blob uploads are served by trioshed's upload path, not through this application")
    st = state()
    root = st.store.pull_root
    found = root is not None and await trio.to_thread.run_sync(has_blob, root, digest)
    return Response("", status=200 if found else 404)


@bp.post("/api/create")
async def create() -> Response:
    st = store_writer()
    body = await read_body()
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest('"stream" must be true or false')
    creator = st.creator()
    prepared = await creator.prepare(body)
    lines = st.writer.start(partial(creator.run, prepared))
    if not stream:
        async with lines:
            async for _ in lines:
                pass
        return Response(json.dumps({"status": "success"}), content_type="application/json")
    response = Response(progress_body(lines, f"create of {prepared.request.name.display()}"), content_type=NDJSON)
    response.timeout = None  # copying a large model file outlasts Quart's RESPONSE_TIMEOUT
    return response


async def progress_body(lines: Lines, what: str) -> AsyncIterator[bytes]:
    """A store operation's progress lines as NDJSON (a streamed body), its error as the last
    line. The operation runs as a task of the store writer (:mod:`trioshed.models.writer`): this
    body only reads a channel, and closing it (the client left) cancels the operation there."""
    async with lines:
        try:
            async for line in lines:
                yield _line(line)
        except TrioshedError as exc:
            log.warning("%s failed: %s", what, exc.message)
            yield _line(ollama_error(exc.status, exc.message))


@bp.post("/api/push")
async def push() -> Response:
    st = store_writer()
    body = await read_body()
    name = _name(body, "model", "name")
    insecure = body.get("insecure", False)
    stream = body.get("stream", True)
    if not isinstance(insecure, bool) or not isinstance(stream, bool):
        raise BadRequest('"insecure" and "stream" must be true or false')
    from trioshed.models import push as pushing

    prepared = await pushing.prepare(st.store, name, insecure=insecure)
    lines = st.writer.start(partial(pushing.run, prepared, writer=st.writer))
    if not stream:
        async with lines:
            async for _ in lines:
                pass
        return Response(json.dumps({"status": "success"}), content_type="application/json")
    response = Response(progress_body(lines, f"push of {prepared.session.target.display}"), content_type=NDJSON)
    response.timeout = None  # a push of gigabytes outlasts Quart's RESPONSE_TIMEOUT
    return response
