"""The generating routes served as plain ASGI, under the same hypercorn, with Quart for the rest.

Per request, Quart builds a request object and a request context, runs a nursery with a task
for the body and one for the answer, matches the URL and runs the hooks; per streamed chunk it
adds a layer to the send path. On the generating routes (``POST`` ``/api/generate``,
``/api/chat``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``,
``/v1/responses``) that is most of what trioshed spends besides the relay itself, so
:class:`FastPath` serves them directly (and blob uploads, whose bodies must be read as they are
written out: :mod:`trioshed.api.routes.upload`):

1. the same :class:`~trioshed.api.pipeline.wrapper.RequestWrapper` as the Quart hooks: the trace, the
   gate (Origin, Host, key, announced size and type, rate), errors and CORS;
2. the whole body is read (bounded by ``TRIOSHED_MAX_BODY`` and the body timeout) before any
   answer starts, so no body is left unread (see :mod:`trioshed.api.pipeline.bodypump`);
3. the route's own function runs, unchanged: :func:`trioshed.api.pipeline.preamble.state` and
   :func:`~trioshed.api.pipeline.preamble.read_body_raw` read :data:`~trioshed.api.pipeline.preamble.fast_request`
   instead of Quart's context;
4. its response is sent as Quart would send it, with the wrapper's CORS headers (a stream's
   parts through the listener's body writer, :meth:`trioshed.api.pipeline.listener._Connection.write_body`:
   the same bytes, without hypercorn's layers for each part); a stream's
   :class:`~trioshed.api.pipeline.upstream.Last` piece goes out with the answer's end, before the body's
   clean-up (the lease, the runner's connection), which then runs without the client waiting.

Whatever is not the plain case goes to the Quart app instead (its own ASGI callable, inside the
trace already started here), which answers it as before and in the same words: a request the
gate refuses (Quart runs the same gate and its early-answer handling), a chunked body over the
limit or one that does not arrive in time (replayed to Quart from what was read). Errors after
that point are answered here through the wrapper's
:meth:`~trioshed.api.pipeline.wrapper.RequestWrapper.on_error`, as Quart's error handler answers them. A
client that leaves cancels the request, as in Quart: the connection tells it
(:class:`~trioshed.api.pipeline.listener.Departure`), without a task per request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from quart import Response
from quart.wrappers.response import DataBody

from trioshed.api.pipeline.bodypump import run_with_pump
from trioshed.api.pipeline.drain import RequestGuard, current_guard
from trioshed.api.pipeline.listener import BODY, DEPARTURE, Departure
from trioshed.api.pipeline.preamble import fast_request
from trioshed.api.pipeline.upstream import Last
from trioshed.api.pipeline.wrapper import Entry, Headers, RequestWrapper
from trioshed.api.routes import upload
from trioshed.api.state import AppState
from trioshed.errors import TrioshedError
from trioshed.fleet.auth import current_signed

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[], Awaitable[Any]]
Write = Callable[[bytes], Awaitable[None]]

log = logging.getLogger(__name__)


class FastPath:
    """Serves ``handlers`` (path -> the Quart view function of ``POST path``) and blob uploads
    (:mod:`trioshed.api.routes.upload`, always: their bodies must not go through Quart's) without
    Quart; everything else, and what is not the plain case, goes to ``app`` (the Quart app's own
    ASGI callable, untraced: every request is traced here, once, by ``wrapper``)."""

    def __init__(
        self,
        app: Callable[[Message, Receive, Send], Awaitable[None]],
        state: AppState,
        wrapper: RequestWrapper,
        handlers: Mapping[str, Handler],
        *,
        body_timeout: float,
    ) -> None:
        self.app = app
        self.state = state
        self.wrapper = wrapper
        self.handlers = dict(handlers)
        self.body_timeout = body_timeout
        self.max_body = state.settings.max_body

    def wants(self, scope: Message) -> bool:
        """A generating route, served by trioshed's listener (which tells the request that its
        client left: :class:`~trioshed.api.pipeline.listener.Departure`; under another server Quart serves it)."""
        return (
            scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.handlers
            and DEPARTURE in scope.get("extensions", ())
        )  # fmt: skip

    async def delegate(self, scope: Message, receive: Receive, send: Send) -> None:
        """The request as Quart serves it."""
        await run_with_pump(self.app, scope, receive, send)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.wrapper.traced(scope, send) as traced_send:
            if self.wants(scope):
                await self._serve(scope, receive, traced_send)
            elif scope["type"] == "http" and upload.wants(scope):
                await self._upload(scope, receive, traced_send)
            else:
                await self.delegate(scope, receive, traced_send)

    def _enter(self, scope: Message, route: str) -> tuple[Entry, Headers, int | None] | None:
        """The gate's entry (not counted yet), the header lookup and the announced length; None
        when the gate refuses (Quart then answers it, after the same checks)."""
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        get = lambda name: headers.get(name.lower())  # noqa: E731
        try:
            length = None if "transfer-encoding" in headers else int(headers.get("content-length", "0"))
            entry = self.wrapper.enter(scope["method"], scope["path"], get, length, route=route, count=False)
        except (TrioshedError, ValueError):
            return None
        return entry, get, length

    async def _upload(self, scope: Message, receive: Receive, send: Send) -> None:
        """A blob upload, streamed to disk in constant memory (:mod:`trioshed.api.routes.upload`)."""
        entered = self._enter(scope, upload.ROUTE)
        if entered is None:
            await self.delegate(scope, receive, send)
            return
        entry, get, length = entered

        async def app(scope: Message, receive: Receive, send: Send) -> None:
            await upload.serve_upload(self.wrapper, entry, scope, receive, send, get, length)

        await run_with_pump(app, scope, receive, send)

    async def _serve(self, scope: Message, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        guard = current_guard()
        entered = self._enter(scope, path)
        if entered is None:
            with _new_scope(guard):
                await self.delegate(scope, receive, send)  # the same checks there, and their answer
            return
        entry, get, _ = entered
        read: list[Message] = []
        body = bytearray()
        answering = False
        take = _taker(receive)
        # One scope for the request: first the body's deadline, then the client's departure.
        with _new_scope(guard, trio.current_time() + self.body_timeout) as scope_of_request:
            while True:
                message = await _next_message(receive, take)
                read.append(message)
                if message["type"] != "http.request":
                    return  # the client left before its body was complete: nobody to answer
                body += message.get("body", b"")
                if len(body) > self.max_body:
                    break
                if not message.get("more_body", False):
                    scope_of_request.deadline = math.inf
                    answering = True
                    departure: Departure = scope["extensions"][DEPARTURE]
                    whole = bytes(body)
                    token = fast_request.set((self.state, whole, scope))
                    departure.watch(scope_of_request)
                    try:
                        await self._answer(method, path, get, send, entry, scope["extensions"][BODY], whole)
                    finally:
                        departure.watch(None)
                        fast_request.reset(token)
                    return
        if answering:
            return  # the client left while its answer was being written
        with _new_scope(guard):
            await self.delegate(scope, _replay(read, receive), send)  # too large, or too slow

    async def _answer(self, method: str, path: str, get: Headers, send: Send, entry: Entry, write: Write, sent: bytes = b"") -> None:
        try:
            if current_signed.get() is not None:  # another node's request: the body it signed
                self.wrapper.check_body(sent)
            self.wrapper.admit(entry, path)
            response = await self.handlers[path]()
        except Exception as exc:
            error = self.wrapper.on_error(method, path, exc)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(error.body)).encode()),
            ]
            headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
            await send({"type": "http.response.start", "status": error.status, "headers": headers + self._finish(get, error.status)})
            await send({"type": "http.response.body", "body": error.body, "more_body": False})
            return
        if not isinstance(response, Response):  # the generating routes answer with a Response
            raise TypeError(f"{path} answered {type(response).__name__}, not a Response")
        headers = [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
        start = {"type": "http.response.start", "status": response.status_code, "headers": headers + self._finish(get, response.status_code)}
        body = response.response
        if isinstance(body, DataBody):  # a whole answer: one message, so one write
            await send(start)
            await send({"type": "http.response.body", "body": body.data[body.begin : body.end], "more_body": False})
            return
        # A stream's route returns with its first piece in hand (its status depends on the runner's
        # first byte: trioshed.api.pipeline.upstream.leased_stream); the head goes out with it (one write:
        # trioshed.api.pipeline.listener).
        await send(start)
        ended = False
        async with body as chunks:
            async for data in chunks:
                if ended:  # nothing may follow the last piece: a defect, not the client's to see
                    log.error("%s yielded %d bytes after its last piece", path, len(data))
                    continue
                if type(data) is Last:  # the end goes out now; the body's clean-up follows
                    ended = True
                    await send({"type": "http.response.body", "body": data, "more_body": False})
                else:
                    await write(data)  # (the listener's: as a body message, less its layers)
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _finish(self, get: Headers, status: int) -> list[tuple[bytes, bytes]]:
        """The wrapper's :meth:`~trioshed.api.pipeline.wrapper.RequestWrapper.finish`, as ASGI headers."""
        return [(name.lower().encode(), value.encode()) for name, value in self.wrapper.finish(get, status)]


def _new_scope(guard: RequestGuard | None, deadline: float = math.inf) -> trio.CancelScope:
    """The scope for the request's next part: the drain's (which cancels it at the end of a
    shutdown), or a plain one outside a drained app."""
    return trio.CancelScope(deadline=deadline) if guard is None else guard.new_scope(deadline)


def _taker(receive: Receive) -> Callable[[], Message] | None:
    """``receive``'s at-once form where it is a memory channel's (hypercorn's), else None."""
    channel = getattr(receive, "__self__", None)
    return channel.receive_nowait if isinstance(channel, trio.MemoryReceiveChannel) else None


async def _next_message(receive: Receive, take: Callable[[], Message] | None) -> Message:
    """The request's next message: taken at once when it is there already (hypercorn puts a
    small request's body and its end before the app first runs), else waited for. A channel's
    ``receive`` yields even then: a turn of the event loop per message before the request could
    go on to its runner. Not a checkpoint when taken at once: the request's send to the runner
    is its next one."""
    if take is not None:
        try:
            return take()
        except trio.WouldBlock:
            pass
    return await receive()


def _replay(read: list[Message], receive: Receive) -> Receive:
    """``receive`` that first gives back the messages already read."""
    pending = list(read)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again
