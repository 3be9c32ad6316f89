"""The HTTP listener: hypercorn's limits, and at most ``TRIOSHED_MAX_CONNECTIONS`` connections.

hypercorn's trio worker accepts without bound; :func:`serve_http` is its ``worker_serve`` for
plain-HTTP sockets with one change: the listener takes a connection slot (a semaphore) before
each ``accept()`` and the connection gives it back when it closes. Connections beyond the bound
wait in the kernel's accept backlog (``config.backlog``) instead of costing a task, a socket and
an h11 buffer each. The limits, and why these values:

- ``h11_max_incomplete_size`` 32 KiB: the request line plus headers must fit (a long API key and
  a browser's cookies do, by far); a 100 KB request line is refused with 431 and closed.
- ``keep_alive_timeout`` = ``TRIOSHED_HTTP_IDLE_TIMEOUT`` (30 s): closes an idle keep-alive
  connection, and also bounds the time a client has to finish sending its headers (hypercorn's
  idle timer runs until the request line and headers are complete), which is what defeats
  slowloris. The official clients (httpx underneath) drop pooled connections after 5 s; behind a
  proxy, set it above the proxy's own idle timeout.
- ``read_timeout`` stays unset: it would apply to every read, also while a long token stream is
  being written to a client that has nothing more to send.
- ``TRIOSHED_MAX_CONNECTIONS`` (512): above any sane number of concurrent clients of one box
  (the load test runs 200), below the default open-file limit of 1024 that the runners share.
- the request body: ``TRIOSHED_MAX_BODY`` and Quart's ``BODY_TIMEOUT`` (see ``app.py``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

from trioshed.config import Settings

MAX_HEADER_BYTES = 32 * 1024
#: Writes taken whole by the socket between two yields of the writing task (:meth:`_Connection._write`).
WRITES_PER_YIELD = 16
GRACEFUL_TIMEOUT = 3.0  # seconds for connections to finish once the listener stopped


def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.read_timeout = None
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.keep_alive_timeout = settings.http_idle_timeout
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    return config


#: The key of a request's :class:`Departure` in its ASGI scope's ``extensions``.
DEPARTURE = "trioshed.departure"
#: The key of a request's body writer in its ASGI scope's ``extensions``: ``await write(data)``
#: sends a part of the answer's body, after its head and before its end (:meth:`_Connection.write_body`).
BODY = "trioshed.body"


class Departure:
    """A connection's client leaving, told to the request being answered on it.

    hypercorn reports a client that leaves by queueing ``http.disconnect`` for the app, which
    only a task reading that queue would see: a task per request. Instead the connection, which
    sees the client go (its read ends), cancels the scope that the request being answered
    registered with :meth:`watch` (the fast path's, :mod:`trioshed.api.pipeline.fast_path`). Not when the
    server closes the connection itself: hypercorn closes a ``Connection: close`` connection from
    inside the answer's last send, and cancelling then would cancel the close.
    """

    __slots__ = ("closing", "scope")

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.closing = False  # the server closes the connection: the client did not leave

    def watch(self, scope: trio.CancelScope | None) -> None:
        """Cancel ``scope`` if the client leaves from now on (None: stop watching)."""
        self.scope = scope

    def left(self) -> None:
        if self.scope is not None and not self.closing:
            self.scope.cancel(reason="client disconnected")


class IdleTimer(TrioSingleTask):
    """hypercorn's keep-alive timer, without a task per request.

    hypercorn runs its idle timer as a task started each time the connection becomes idle (its
    answer ended) and cancelled each time a request's headers are complete: a task spawned, a
    lock taken twice and a scope per request. This one task per connection waits the whole
    connection long, in a scope whose deadline the connection moves: ``timeout`` from each time
    it becomes idle, none while a request is being answered. The same closes follow: an idle
    connection at its deadline (so also one whose request line and headers do not arrive in
    time), and an idle one at once when the server shuts down (one busy then closes itself once
    its answer ended, as in hypercorn). :meth:`end` stops it when the connection closes.
    """

    def __init__(self, timeout: float, terminated: Any, close: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._timeout = timeout
        self._terminated = terminated
        self._close = close
        self._scope: trio.CancelScope | None = None
        self._ended = False

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        """The connection is idle from now."""
        deadline = trio.current_time() + self._timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            task_group.spawn(self._watch)
        elif not self._ended:
            self._scope.deadline = deadline

    async def stop(self) -> None:
        """A request is being answered: no deadline until it is idle again."""
        if self._scope is not None:
            self._scope.deadline = math.inf

    def end(self) -> None:
        """The connection closed: the task ends."""
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self) -> None:
        assert self._scope is not None
        with self._scope:
            await self._terminated.wait()
        if self._ended or (self._scope.deadline == math.inf and not self._scope.cancelled_caught):
            return  # closed, or the server shuts down while an answer is under way
        self._ended = True
        with trio.CancelScope(shield=True):
            await self._close()


class _Connection(TCPServer):
    """hypercorn's connection, with these changes:

    - once the client has closed it no longer waits out its keep-alive timer (it did: every
      closed connection held its slot for up to 30 s, so clients opening a connection per
      request would have been limited to ~17 requests/s);
    - a response's head is written with the first bytes of its body (or its end), in one write,
      as Go's server (Ollama's) does: hypercorn wrote it alone, and each write is a packet and a
      wake-up of the client. Every response ends with a write of its own (its last chunk, or an
      empty one), so a held head always goes out; ``100 Continue`` is never held;
    - each request's scope carries the connection's :class:`Departure` (``extensions``);
    - a write the socket takes whole is made at once, and a read costs no cancel scope
      (:meth:`_write`, :meth:`_read_data`);
    - its keep-alive timer is one task for the connection (:class:`IdleTimer`), not one per
      request;
    - a request's messages are handed to the app without a yield each (:meth:`_put_at_once`).
    """

    _head: bytes | None = None
    _chunked = False  # the answer under way is chunked (:meth:`write_body`)
    _writes = 0  # taken at once, for the yield every WRITES_PER_YIELD

    def __init__(self, app: Any, config: Config, context: WorkerContext, state: Any, stream: Any) -> None:
        departure = self.departure = Departure()

        write_body = self.write_body

        async def with_departure(scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
            extensions = scope.setdefault("extensions", {})
            extensions[DEPARTURE], extensions[BODY] = departure, write_body
            await app(scope, receive, send, sync_spawn, call_soon)

        super().__init__(with_departure, config, context, state, stream)
        self.idle_task = self.idle_timer = IdleTimer(config.keep_alive_timeout, context.terminated, self._initiate_server_close)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            data = event.data
            if self._head is not None:
                data, self._head = self._head + data, None
            elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 1"):
                self._head = data
                self._chunked = b"\r\ntransfer-encoding: chunked\r\n" in data.lower()  # as h11 frames the body
                return
            await self._write(data)
            return
        if isinstance(event, Closed):
            self.departure.closing = True
        if self._head is not None:
            head, self._head = self._head, None
            await self._write(head)
        await super().protocol_send(event)

    async def write_body(self, data: bytes) -> None:
        """A part of the answer's body (not its last; an answer without ``Content-Length``), framed
        as h11 frames it (a chunk, or the bytes as they are for an HTTP/1.0 client) and written as
        :meth:`protocol_send` writes: the same bytes as an ASGI ``http.response.body`` message,
        without hypercorn's and h11's layers for each part (a stream sends one per token). The
        answer's end still goes through them, which keeps their state (h11 counts no bytes of a
        chunked body)."""
        if not data:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        if self._head is not None:
            data, self._head = self._head + data, None
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        """``data`` to the client. Written at once when the socket takes all of it (a response's
        parts are far smaller than its buffer) and no other write is under way, without
        hypercorn's lock and shielded scope and Trio's two checkpoints (a task switch) per write:
        several writes a response, most of the cost of writing. Else (a full buffer, a write
        under way) hypercorn's own write, which waits. Every :data:`WRITES_PER_YIELD` writes
        taken at once the task yields, so a long answer cannot hold the event loop."""
        if self._writes >= WRITES_PER_YIELD:
            self._writes = 0
            await trio.lowlevel.checkpoint()  # before a write, not after: an answer's end goes out last
        if not self.send_lock.locked():
            try:
                sent = self._write_now(data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken, closed: as hypercorn handles a write that fails
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                self._writes += 1
                return
            data = data[sent:]
        await super().protocol_send(RawData(data=data))

    def _write_now(self, data: bytes) -> int:
        """The bytes of ``data`` that the socket takes now (BlockingIOError: none)."""
        return os.write(self.stream.socket.fileno(), data)

    def _put_at_once(self) -> None:
        """hypercorn hands a request's messages (its body, its end, then ``http.disconnect``) to
        the app through a memory channel whose ``send`` yields every time, also inside an
        answer's last send, after its last write: the client could then act on a whole answer
        before the request's clean-up ran (a stream's lease given back after its end went out:
        :class:`~trioshed.api.pipeline.upstream.Last`). Put at once when the channel has room instead (a
        yield fewer per message); a full channel waits as before."""
        group = self._task_group
        spawn_app = group.spawn_app

        async def spawn(*args: Any) -> Callable[[Any], Awaitable[None]]:
            put = await spawn_app(*args)
            channel = put.__self__  # type: ignore[attr-defined]  # the channel's bound send

            async def put_at_once(message: Any) -> None:
                try:
                    channel.send_nowait(message)
                except trio.WouldBlock:
                    await put(message)

            return put_at_once

        group.spawn_app = spawn  # type: ignore[method-assign,assignment]

    async def _read_data(self) -> None:
        """hypercorn's read loop, less a cancel scope per read for ``read_timeout`` (which
        trioshed leaves unset: :func:`hypercorn_config`); then the client's departure."""
        self._put_at_once()
        if self.config.read_timeout is not None:
            await super()._read_data()
        else:
            while True:
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                await self.protocol.handle(RawData(bytes(data)))
                if not data:
                    break
            await self.protocol.handle(Closed())
        self.departure.left()
        self.idle_timer.end()


class ConnectionStats:
    """The connection bound and what is open now (for tests and STATUS)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.slots = trio.Semaphore(limit)
        self.accepted = 0
        self.open = 0


class BoundedListener(trio.abc.Listener[trio.SocketStream]):
    """A SocketListener that accepts only while fewer than ``slots`` connections are open."""

    def __init__(self, inner: trio.SocketListener, stats: ConnectionStats) -> None:
        self.inner = inner
        self.stats = stats

    async def accept(self) -> trio.SocketStream:
        await self.stats.slots.acquire()
        try:
            stream = await self.inner.accept()
        except BaseException:
            self.stats.slots.release()
            raise
        self.stats.accepted += 1
        return stream

    async def aclose(self) -> None:
        await self.inner.aclose()


async def serve_http(
    app: Any,
    config: Config,
    connections: ConnectionStats,
    *,
    shutdown_trigger: Any,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's ``worker_serve`` (plain HTTP) with bounded connections; returns the URLs bound."""
    config.set_statsd_logger_class(StatsdLogger)
    app = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners, binds = [], []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(BoundedListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), connections))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            connection = partial(_Connection, app, config, context, ConnectionState(lifespan_state.copy()))

            async def handle(stream: trio.SocketStream) -> None:
                connections.open += 1
                try:
                    await connection(stream)  # type: ignore[arg-type]  # hypercorn types it as SSL only
                finally:
                    connections.open -= 1
                    connections.slots.release()

            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(partial(trio.serve_listeners, handle, listeners, handler_nursery=server_nursery))
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
                if other_errors is not None:
                    raise other_errors from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
