"""``POST /api/blobs/<digest>`` (Ollama's blob upload, what ``ollama create`` sends a local GGUF
with) served as plain ASGI, so that a body of any size is held in constant memory.

Quart reads a request's whole body into memory as it arrives, with no backpressure (a 1 GiB
upload grew the server by 570 MiB). Here the body is taken from hypercorn one message at a time,
only when :func:`~trioshed.models.blobs.receive_blob` asks for the next one: while a batch is
being hashed and written in a worker thread nothing is read, hypercorn's queue of ten messages
fills, it stops reading the socket, and TCP slows the sender down. What one upload holds is
therefore bounded: :data:`~trioshed.models.blobs.UPLOAD_BATCH` (4 MiB) plus one message (at most
64 KiB), plus hypercorn's queue (10 messages).

The request goes through the same :class:`~trioshed.api.pipeline.wrapper.RequestWrapper` as every other
(the fast path, :mod:`trioshed.api.pipeline.fast_path`, calls :func:`serve_upload` after the gate let it in):
the trace, the gate, errors in Ollama's shape, CORS. The answers are the Quart route's: 201 new,
200 there already (the body unread), 400 digest mismatch or a short body, 403 no writable store
or a folder that may not be written, 413, 503 out of files, 507 out of disk; an error answer says
``Connection: close`` (the rest of the body is not read). A client that leaves mid-upload cancels
it, and its partial file is removed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import trio

from trioshed.api.pipeline.preamble import fast_request, store_writer
from trioshed.api.pipeline.wrapper import Entry, Headers, RequestWrapper
from trioshed.errors import Forbidden
from trioshed.models.blobs import has_blob, receive_blob

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PREFIX = "/api/blobs/"
ROUTE = "/api/blobs/<digest>"


def wants(scope: Message) -> bool:
    """``POST /api/blobs/<digest>`` (one path segment, as Quart's route matches it)."""
    path = scope["path"]
    return scope["method"] == "POST" and path.startswith(PREFIX) and "/" not in path[len(PREFIX) :] and path != PREFIX


class _Disconnected(Exception):
    """The client left before its body was complete."""


async def _body(receive: Receive) -> AsyncGenerator[bytes, None]:
    """The request body, one ASGI message at a time, read only when asked for."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Disconnected
        data = message.get("body", b"")
        if data:
            yield data
        if not message.get("more_body", False):
            return


async def serve_upload(
    wrapper: RequestWrapper, entry: Entry, scope: Message, receive: Receive, send: Send, get: Headers, length: int | None
) -> None:
    """Answer an upload the gate let in (``entry``, not counted yet), under
    :func:`~trioshed.api.pipeline.bodypump.run_with_pump`, which discards what is left of a body not read
    and closes the connection then."""
    path = scope["path"]
    token = fast_request.set((wrapper.gate.state, b"", scope))
    try:
        try:
            wrapper.admit(entry, path)
            status = await _receive(path[len(PREFIX) :], receive, length)
        except _Disconnected:
            return  # nobody to answer; receive_blob removed the partial file
        except Exception as exc:
            error = wrapper.on_error("POST", path, exc)
            headers = {**error.headers, "Connection": "close"}  # the rest of the body is not read
            await _answer(send, wrapper, get, error.status, error.body, headers)
            return
        await _answer(send, wrapper, get, status, b"", {"Connection": "close"} if status == 200 else {})
    finally:
        fast_request.reset(token)


async def _receive(digest: str, receive: Receive, length: int | None) -> int:
    st = store_writer()
    root = st.store.pull_root
    if root is None:
        raise Forbidden("blob uploads need a folder store to write into (its pulled/ folder); every folder in "
                        "TRIOSHED_MODELS is a read-only Ollama store")  # fmt: skip
    if await trio.to_thread.run_sync(has_blob, root, digest):
        return 200  # the body is not read
    body = _body(receive)
    try:
        new = await receive_blob(root, digest, body, length=length)
    finally:
        await body.aclose()
    return 201 if new else 200


async def _answer(send: Send, wrapper: RequestWrapper, get: Headers, status: int, body: bytes, headers: dict[str, str]) -> None:
    fields = [(b"content-length", str(len(body)).encode())]
    if body:
        fields.append((b"content-type", b"application/json"))
    fields += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    fields += [(name.lower().encode(), value.encode()) for name, value in wrapper.finish(get, status)]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body, "more_body": False})

