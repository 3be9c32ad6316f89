"""A runner's HTTP/1.1 client: one pool of keep-alive connections to its llama-server (loopback).

The hot path of every request: httpx + httpcore cost a third of trioshed's CPU per streamed
request (bench findings, 2026-12-02); this does only what llama-server needs, on Trio streams,
with :mod:`trioshed.runner.wire` reading the answers.

Stale connections. llama-server (cpp-httplib, measured on the bundled b10068 with
``/tmp``-style raw sockets: ``Keep-Alive: timeout=5, max=100``) closes a keep-alive connection
after **5 s idle** and after **100 requests** (the 100th answer carries ``Connection: close``).
A request written to a connection in the instant the upstream closes it gets no answer at all
(seen as "502 ... Server disconnected without sending a response"). So:

* llama-server closes the connection right after the last chunk of a *streamed* (chunked)
  answer, although it announced keep-alive (measured: the FIN is there as soon as the final
  ``0\r\n\r\n`` is read, on ``/completion`` and ``/v1/chat/completions`` alike); reusing such
  a connection races that close, so it is closed on our side too and a stream always gets a
  fresh connection (direct clients of llama-server pay the same connect);
* so that a stream does not wait for that connect, the pool opens the next connection as the
  last one closes (a non-blocking connect: the handshake and llama-server's accept happen while
  the answer is relayed and before the next request arrives), keeping at most one ready and
  idle; it is offered like an idle connection, and closed with them after :data:`KEEP_IDLE`;
* an idle connection is reused only within :data:`KEEP_IDLE` (2 s, well inside 5 s), for at
  most :data:`MAX_REQUESTS` requests, and only when a non-blocking peek shows it still open;
* a request on a *reused* connection that the upstream closes (or resets) before sending a
  single byte of answer is sent once more on a *fresh* connection: the upstream never saw it,
  so this is safe even for a generation. A fresh connection that fails is a real failure
  (usually the child died), and so is an answer cut after its first byte.

Cancellation: a request cancelled mid-answer closes its connection (llama-server then stops the
generation); only connections whose answer was read to the end go back to the pool.

TLS: the fleet's relays to another node reached over ``https://`` use the same pool with an
``ssl_context`` (each connection's handshake verified against it; nothing opened ahead).
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, cast

import trio

from trioshed.core.speculation import drafted_accepted
from trioshed.runner.wire import ProtocolError, ResponseReader, request_head

__all__ = [
    "KEEP_IDLE", "MAX_REQUESTS", "ConnectionFailed", "PoolStats", "UpstreamPool", "UpstreamResponse", "Watched",
    "watched",
]  # fmt: skip

#: Seconds an idle connection is kept for reuse (llama-server closes it after 5 s idle).
KEEP_IDLE = 2.0
#: Requests per connection before it is retired (llama-server closes it after 100).
MAX_REQUESTS = 90
_READ = 65536


class Closable(Protocol):
    def close(self) -> None: ...


class Watched:
    """Where the waits of one step of a request can be ended from outside: the connection the
    pool is using for it, noted by :meth:`UpstreamPool.request` while :data:`watched` holds this
    (``trioshed.api.pipeline.upstream``: a step on a runner that stalls is ended by closing it)."""

    __slots__ = ("connection",)

    def __init__(self) -> None:
        self.connection: Closable | None = None

    def abort(self) -> None:
        """Close the connection in use (none yet: nothing to close, the step runs on)."""
        if self.connection is not None:
            self.connection.close()


#: The :class:`Watched` of the step under way in this task (None: its waits are not watched).
watched: ContextVar[Watched | None] = ContextVar("trioshed_watched_connection", default=None)


class ConnectionFailed(Exception):
    """The connection to llama-server failed: refused, reset, closed or answered garbage."""

    def __init__(self, message: str, *, received: int = 0) -> None:
        super().__init__(message)
        self.received = received  # bytes of the answer received before the failure


class _Connection:
    __slots__ = ("idle_since", "raw", "requests", "sock", "stream")

    def __init__(self, raw: socket.socket, stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> None:
        self.raw = raw  # the same socket, for the non-blocking liveness peek
        self.sock = stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket
        # an SSLStream's receive_some gives bytes too (ssl's read), though typed as any stream's
        self.stream = cast(trio.SocketStream, stream)
        self.requests = 0
        self.idle_since = 0.0

    def still_open(self) -> bool:
        """Whether the upstream has not closed (or written to) this idle connection."""
        try:
            self.raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing to read: open
        except OSError:
            return False
        return False  # closed (b"") or unexpected bytes: not usable for a new request

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class PoolStats:
    idle: int
    active: int
    opened: int
    reused: int
    retried: int
    #: Connections opened ahead (as a stream's connection closed) and then taken by a request.
    ready: int = 0
    #: Speculative decoding: tokens drafted and accepted in the answers read to their end
    #: (llama-server's ``timings.draft_n``/``draft_n_accepted``).
    drafted: int = 0
    accepted: int = 0


class UpstreamResponse:
    """An answer whose head was read; its body is read with :meth:`batches` or :meth:`read`."""

    def __init__(self, connection: _Connection, reader: ResponseReader, first: bytes) -> None:
        self._connection = connection
        self._reader = reader
        self._first = first
        self._tail = (b"", b"")  # the last two pieces read: where the final timings are
        self.status: int = reader.status or 0
        self.headers = reader.headers

    @property
    def complete(self) -> bool:
        return self._reader.done

    @property
    def keep_alive(self) -> bool:
        """Whether the upstream keeps the connection open after this answer."""
        return self._reader.keep_alive

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another request: the answer was read to its end,
        the upstream did not say ``close``, and it was not a stream (see the module's notes)."""
        reader = self._reader
        return reader.done and reader.keep_alive and not reader.chunked

    async def batches(self) -> AsyncGenerator[bytes, None]:
        """The body, de-chunked, one piece per socket read (never an empty piece)."""
        first, self._first = self._first, b""
        if first:
            self._tail = (b"", first)
            yield first
        reader, stream = self._reader, self._connection.stream
        while not reader.done:
            try:
                data = await stream.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectionFailed(f"reading llama-server's answer failed: {exc}", received=reader.received) from None
            try:
                if not data:
                    reader.feed_eof()
                    break
                body = reader.feed(data)
            except ProtocolError as exc:
                raise ConnectionFailed(str(exc), received=reader.received) from None
            if body:
                self._tail = (self._tail[1], body)
                yield body

    def abort(self) -> None:
        """Close the connection now: a read under way, and every later one, fails
        (:class:`ConnectionFailed`); the pool does not take it back."""
        self._connection.close()

    def tail(self) -> bytes:
        """The last two pieces of the body read so far (the final event and ``[DONE]``)."""
        return b"".join(self._tail)

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.batches()])


class UpstreamPool:
    """Keep-alive connections to one llama-server; ``request()`` borrows one per request.

    Owned by its runner, which closes it (``aclose``) before the child stops.
    """

    def __init__(
        self, port: int, *, host: str = "127.0.0.1", max_idle: int = 16, connect_timeout: float = 10.0, api_key: str | None = None,
        streams_keep_alive: bool = False, ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.ssl_context = ssl_context  # TLS, verified against it (another node over https://)
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        #: Whether a connection that carried a whole stream may carry another: not to llama-server
        #: (see the module's notes), yes to another trioshed (hypercorn keeps it open).
        self.streams_keep_alive = streams_keep_alive
        self.port = port
        self._api_key = api_key  # the runner's secret, sent with every request (never logged)
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._active = 0
        self._opened = 0
        self._reused = 0
        self._retried = 0
        self._ready = 0
        self._drafted = 0
        self._accepted = 0
        self._closed = False

    def statistics(self) -> PoolStats:
        return PoolStats(
            len(self._idle), self._active, self._opened, self._reused, self._retried, self._ready, self._drafted, self._accepted
        )

    @asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", *, content_type: str = "application/json",
        headers: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[UpstreamResponse]:
        """Send a request and yield its answer once the head arrived; the body is read inside.

        Raises :class:`ConnectionFailed` when no answer could be had (after the one retry that
        a stale pooled connection earns).
        """
        head = request_head(method, path, self.port, len(body), content_type, self._api_key, host=self.host, extra=headers)
        data = head + body
        connection = self._take_idle()
        reused = connection is not None
        if connection is None:
            connection = await self._connect()
        watch = watched.get()
        if watch is not None:
            watch.connection = connection
        self._active += 1
        try:
            try:
                response = await self._send(connection, data, method)
            except ConnectionFailed as exc:
                connection.close()
                if not (reused and exc.received == 0):
                    raise
                self._retried += 1  # the upstream closed it as we wrote: it never saw the request
                connection = await self._connect()
                if watch is not None:
                    watch.connection = connection
                response = await self._send(connection, data, method)
            yield response
        except BaseException:
            connection.close()
            raise
        finally:
            self._active -= 1
            if watch is not None and watch.connection is connection:
                watch.connection = None  # it may go back to the pool: not this step's to close
        if response.complete:
            counts = drafted_accepted(response.tail())
            if counts is not None:
                self._drafted += counts[0]
                self._accepted += counts[1]
        self._give_back(connection, response)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.request("GET", path) as response:
            return response.status, await response.read()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.request("POST", path, body) as response:
            return response.status, await response.read()

    async def _send(self, connection: _Connection, data: bytes, method: str) -> UpstreamResponse:
        reader = ResponseReader(head_only=method == "HEAD")
        stream = connection.stream
        connection.requests += 1
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionFailed(f"connection to llama-server failed: {_describe(exc)}", received=0) from None
        try:
            first = b""
            while reader.status is None:
                chunk = await stream.receive_some(_READ)
                if not chunk:
                    reader.feed_eof()
                first = reader.feed(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionFailed(f"connection to llama-server failed: {_describe(exc)}", received=reader.received) from None
        except ProtocolError as exc:
            raise ConnectionFailed(str(exc), received=reader.received) from None
        return UpstreamResponse(connection, reader, first)

    async def _connect(self) -> _Connection:
        if self._closed:
            raise ConnectionFailed("the runner's connections are closed (it is stopping)")
        raw = socket.socket(self._family, socket.SOCK_STREAM)
        raw.setblocking(False)
        sock = trio.socket.from_stdlib_socket(raw)
        try:
            with trio.fail_after(self.connect_timeout):
                await sock.connect((self.host, self.port))
        except (OSError, trio.TooSlowError) as exc:
            sock.close()
            raise ConnectionFailed(f"cannot connect to llama-server on port {self.port}: {_describe(exc)}") from None
        except BaseException:
            sock.close()
            raise
        plain = trio.SocketStream(sock)
        if self.ssl_context is None:
            self._opened += 1
            return _Connection(raw, plain)
        tls = trio.SSLStream(plain, self.ssl_context, server_hostname=self.host, https_compatible=True)
        try:
            with trio.fail_after(self.connect_timeout):
                await tls.do_handshake()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            sock.close()
            raise ConnectionFailed(f"TLS with {self.host}:{self.port} failed: {_describe(exc)}") from None
        except BaseException:
            sock.close()
            raise
        self._opened += 1
        return _Connection(raw, tls)

    def _open_ahead(self) -> None:
        """Start connecting the next request's connection now, without waiting for it (see the
        module's notes); a connect that fails leaves nothing behind (the next request connects)."""
        if self.ssl_context is not None:
            return  # a TLS connection's handshake is made when it is used
        raw = socket.socket(self._family, socket.SOCK_STREAM)
        raw.setblocking(False)
        if raw.connect_ex((self.host, self.port)) not in (0, errno.EINPROGRESS):
            raw.close()
            return
        self._opened += 1
        connection = _Connection(raw, trio.SocketStream(trio.socket.from_stdlib_socket(raw)))
        connection.idle_since = trio.current_time()
        self._idle.append(connection)

    def _take_idle(self) -> _Connection | None:
        now = trio.current_time()
        while self._idle:
            connection = self._idle.pop()  # the most recently used: the least likely to be stale
            if now - connection.idle_since < KEEP_IDLE and connection.still_open():
                if connection.requests:
                    self._reused += 1
                else:
                    self._ready += 1
                return connection
            connection.close()
        return None

    def _give_back(self, connection: _Connection, response: UpstreamResponse) -> None:
        reusable = response.reusable or (self.streams_keep_alive and response.complete and response.keep_alive)
        if (
            self._closed
            or not reusable
            or connection.requests >= MAX_REQUESTS
            or len(self._idle) >= self.max_idle
        ):
            connection.close()
            if not self._closed and not self._idle and response.complete:
                self._open_ahead()
            return
        now = trio.current_time()
        # Connections idle too long are closed now rather than kept until the next request.
        while self._idle and now - self._idle[0].idle_since >= KEEP_IDLE:
            self._idle.pop(0).close()
        connection.idle_since = now
        self._idle.append(connection)

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        await trio.lowlevel.checkpoint()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        return str(exc.__cause__) or type(exc.__cause__).__name__  # the TLS error (a certificate not trusted...)
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})"
    return str(exc) or type(exc).__name__
