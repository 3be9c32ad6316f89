"""Ollama's model-management routes: /api/delete, /api/copy, and the ones trioshed leaves out.

* ``DELETE /api/delete``: a model of trioshed's own folder store is unloaded (unless another
  name still serves its file), then its GGUF file (or its ``models.toml`` name) removed; a
  pulled model's manifest is removed with the blobs no other pulled model uses; a model of an
  Ollama store is 403 (read-only).
* ``POST /api/copy``: a ``models.toml`` entry ``destination`` naming the source's files.
* ``/api/push``, ``/api/create``, ``HEAD``/``POST /api/blobs/:digest``: 501 with how to add a
  model instead, whatever the body's size. trioshed uploads nothing and builds no models
  (``/api/pull`` is :mod:`trioshed.api.pull`).
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response

from trioshed.api.preamble import read_body, state
from trioshed.errors import BadRequest, NotSupported

bp = Blueprint("manage", __name__)

HOW_TO_ADD = (
    "to add a model, pull it (trioshed pull NAME, or /api/pull), copy its GGUF file into the model store (TRIOSHED_MODELS; NAME.gguf "
    "is model NAME), or point TRIOSHED_MODELS at an existing Ollama store "
    "(e.g. ~/.ollama/models, several folders separated by ':')"
)


def _name(body: dict[str, object], *keys: str) -> str:
    for key in keys:
        value = body.get(key)
        if isinstance(value, str) and value.strip():
            return value
    raise BadRequest(f'"{keys[0]}" is required')


@bp.delete("/api/delete")
async def delete() -> Response:
    st = state()
    body = await read_body()
    name = _name(body, "model", "name")
    spec = await trio.to_thread.run_sync(st.store.find_for_delete, name)
    if not await trio.to_thread.run_sync(st.store.shares_file, spec):
        await st.scheduler.unload(spec)  # waits until its runners have exited
    await trio.to_thread.run_sync(st.store.delete, name)
    return Response("", status=200)


@bp.post("/api/copy")
async def copy() -> Response:
    st = state()
    body = await read_body()
    source = _name(body, "source")
    destination = _name(body, "destination")
    await trio.to_thread.run_sync(st.store.copy, source, destination)
    return Response("", status=200)


def _not_supported(what: str) -> NotSupported:
    """The 501 to raise. The body is not read (a blob upload may be gigabytes): the answer closes
    the connection, so that a keep-alive client sends its next request on a new one instead of
    finding this one gone."""
    return NotSupported(f"trioshed does not {what}; {HOW_TO_ADD}", headers={"Connection": "close"})


@bp.post("/api/push")
async def push() -> Response:
    raise _not_supported("upload models (/api/push)")


@bp.post("/api/create")
async def create() -> Response:
    raise _not_supported("create models from a Modelfile (/api/create)")


@bp.route("/api/blobs/<digest>", methods=["HEAD", "POST"])
async def blobs(digest: str) -> Response:
    raise _not_supported("store uploaded blobs (/api/blobs)")
