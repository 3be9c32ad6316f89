"""The hop to llama-server: pooled keep-alive connections that the upstream may close.

llama-server (cpp-httplib, b10068, measured): an idle keep-alive connection is closed after
5 s, and a connection serves at most 100 requests (the 100th answer says ``Connection: close``).
A request sent on a pooled connection just as the upstream closes it gets no answer at all; it
must be sent again on a fresh connection (safe: the upstream never saw it), never answered 502.

The upstream here is a small Trio server that does exactly that, deterministically: it answers
the first ``answer`` requests of each connection and closes the connection, without a byte of
answer, when the next one arrives.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio
import trio.testing

from trioshed.api.pipeline.upstream import open_upstream, post_upstream
from trioshed.core.context import Shrunk
from trioshed.core.model import MeasuredMemory, ModelSpec, RunnerOptions
from trioshed.errors import RunnerCrashed, RunnerError, UpstreamError
from trioshed.runner.client import KEEP_IDLE, UpstreamPool, Watched, watched
from trioshed.runner.process import OutputTail
from trioshed.runner.slots import RunnerSlots
from trioshed.runner.wire import ProtocolError, ResponseReader, request_head

_SSE = b"".join(
    b"data: " + json.dumps({"content": piece, "stop": piece == ""}).encode() + b"\n\n"
    for piece in ("Hel", "lo", "")
)


@dataclass
class ClosingUpstream:
    """Answers ``answer`` requests per connection, then drops the connection at the next one.

    ``partial``: when dropping, first send the start of a response (the upstream saw the request:
    that one must not be sent again).
    """

    answer: int = 1
    partial: bool = False
    port: int = 0
    connections: int = 0
    requests: list[tuple[int, str]] = field(default_factory=list)  # (connection, path) as received
    dropped: int = 0
    ended: int = 0  # connections that reached their end (EOF from the client, or dropped)
    one_ended: trio.Event = field(default_factory=trio.Event)

    async def _read_request(self, stream: trio.SocketStream, buffer: bytearray) -> str | None:
        while b"\r\n\r\n" not in buffer:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return None
            buffer += chunk
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next((int(ln.split(":", 1)[1]) for ln in lines if ln.lower().startswith("content-length:")), 0)
        while len(rest) < length:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return None
            rest += chunk
        buffer[:] = rest[length:]
        return lines[0].split()[1]

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        buffer = bytearray()
        try:
            await self._answer(stream, number, buffer)
        finally:
            self.ended += 1
            self.one_ended.set()

    async def _answer(self, stream: trio.SocketStream, number: int, buffer: bytearray) -> None:
        async with stream:
            served = 0
            while (path := await self._read_request(stream, buffer)) is not None:
                self.requests.append((number, path))
                if served == self.answer:
                    self.dropped += 1
                    if self.partial:
                        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-")
                    return  # what cpp-httplib does when its keep-alive wait ends as a request comes
                served += 1
                if path == "/completion":
                    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_SSE), _SSE)
                    await stream.send_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                    )
                else:
                    body = json.dumps({"n": served, "connection": number}).encode()
                    await stream.send_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5, max=100\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                    )

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[ClosingUpstream]:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
            self.port = listeners[0].socket.getsockname()[1]
            yield self
            nursery.cancel_scope.cancel()


class _Runner:
    """A runner handle (:class:`RunnerHandle`, in full) whose upstream is the stand-in server: its
    own pooled client. There is no child: it never exits and cannot be killed."""

    def __init__(self, port: int) -> None:
        self.upstream = UpstreamPool(port)
        self.base_url = f"http://127.0.0.1:{port}"
        self.pid: int | None = None
        self.returncode: int | None = None
        self.exited = False
        self.measured: MeasuredMemory | None = None
        self.speculation = (0, 0)
        self.slots: RunnerSlots | None = None
        self.tail = OutputTail()

    async def wait_exited(self) -> int | None:
        await trio.sleep_forever()
        return None  # pragma: no cover

    async def health(self) -> bool:
        return True

    def kill(self) -> None:
        pass


class _Lease:
    """A lease (:class:`LeaseView`, in full) on the stand-in; not the scheduler's, so a request
    that fails cannot run again."""

    def __init__(self, port: int) -> None:
        self.model = ModelSpec("fake:latest", "/dev/null")
        self.options = RunnerOptions()
        self.handle = _Runner(port)
        self.load_duration = 0.0
        self.crash: RunnerCrashed | None = None
        self.shrunk: Shrunk | None = None
        self.rerun_after: RunnerError | None = None
        self.released = False
        self.lora: list[dict[str, object]] | None = None  # no adapters to select

    async def death(self) -> RunnerCrashed | None:
        return None  # no child: a broken connection is never a death

    def produced(self) -> None:
        pass

    def evict(self, reason: str) -> None:
        pass

    def waiting_for_answer(self) -> AbstractContextManager[None]:
        return nullcontext()

    async def rerun(self, crash: RunnerError) -> None:
        raise crash

    async def regrow(self, num_ctx: int) -> None:
        raise RuntimeError("the stand-in's context is never made smaller")

    def release(self) -> None:
        self.released = True


async def _stream_text(lease: _Lease) -> str:
    text = ""
    async with open_upstream(lease, "/completion", {"prompt": "x"}) as batches:
        async for lines in batches:
            text += "".join(json.loads(ln[6:])["content"] for ln in lines if ln.startswith(b"data: "))
    return text


async def test_post_on_a_connection_the_upstream_closed_is_sent_again_on_a_fresh_one() -> None:
    with trio.fail_after(10):
        async with ClosingUpstream(answer=1).serving() as upstream:
            lease = _Lease(upstream.port)
            first = await post_upstream(lease, "/health", {})
            second = await post_upstream(lease, "/health", {})
            await lease.handle.upstream.aclose()
    assert (first["connection"], second["connection"]) == (1, 2)
    # the second request reached connection 1 as it closed, then was answered on connection 2
    assert upstream.requests == [(1, "/health"), (1, "/health"), (2, "/health")]
    assert upstream.dropped == 1


async def test_stream_on_a_connection_the_upstream_closed_is_sent_again_on_a_fresh_one() -> None:
    with trio.fail_after(10):
        async with ClosingUpstream(answer=1).serving() as upstream:
            lease = _Lease(upstream.port)
            await post_upstream(lease, "/health", {})
            assert await _stream_text(lease) == "Hello"
            await lease.handle.upstream.aclose()
    assert upstream.requests == [(1, "/health"), (1, "/completion"), (2, "/completion")]


async def test_a_connection_that_carried_a_stream_is_not_reused() -> None:
    # llama-server closes the connection right after a streamed answer's last chunk (measured on
    # b10068) although it announced keep-alive: reusing it would race that close.
    with trio.fail_after(10):
        async with ClosingUpstream(answer=100).serving() as upstream:
            lease = _Lease(upstream.port)
            assert await _stream_text(lease) == "Hello"
            assert await _stream_text(lease) == "Hello"
            await post_upstream(lease, "/health", {})
            await post_upstream(lease, "/health", {})
            stats = lease.handle.upstream.statistics()
            await lease.handle.upstream.aclose()
    assert [c for c, _ in upstream.requests] == [1, 2, 3, 3]
    assert (stats.opened, stats.reused, stats.retried) == (3, 1, 0)


async def test_the_next_streams_connection_is_opened_as_the_last_one_closes() -> None:
    # A stream's connection is closed after it (llama-server closes it); the pool starts the
    # next connect at once, so the next stream is written to a connection already open.
    with trio.fail_after(10):
        async with ClosingUpstream(answer=100).serving() as upstream:
            lease = _Lease(upstream.port)
            assert await _stream_text(lease) == "Hello"
            after_one = lease.handle.upstream.statistics()
            assert await _stream_text(lease) == "Hello"
            after_two = lease.handle.upstream.statistics()
            await lease.handle.upstream.aclose()
    assert (after_one.opened, after_one.idle, after_one.ready) == (2, 1, 0)  # the second one is ready
    assert (after_two.opened, after_two.ready, after_two.reused) == (3, 1, 0)
    assert [c for c, _ in upstream.requests] == [1, 2]


async def test_a_connection_opened_ahead_to_a_server_that_went_away_costs_nothing() -> None:
    # The upstream stops after a stream: the connection opened ahead is refused or dropped, and
    # the next request fails as on a fresh connection (no retry loop, no connection left open).
    with trio.fail_after(10):
        async with ClosingUpstream(answer=100).serving() as upstream:
            lease = _Lease(upstream.port)
            assert await _stream_text(lease) == "Hello"
        with pytest.raises(UpstreamError, match="llama-server"):
            await post_upstream(lease, "/health", {})
        stats = lease.handle.upstream.statistics()
        await lease.handle.upstream.aclose()
    assert (stats.active, stats.idle) == (0, 0)


async def test_a_fresh_connection_closed_without_an_answer_is_an_error_not_a_loop() -> None:
    with trio.fail_after(10):
        async with ClosingUpstream(answer=0).serving() as upstream:
            lease = _Lease(upstream.port)
            with pytest.raises(UpstreamError, match="llama-server"):
                await post_upstream(lease, "/health", {})
            await lease.handle.upstream.aclose()
    assert len(upstream.requests) <= 2  # never more than the one retry


async def test_an_answer_cut_after_its_first_bytes_is_not_sent_again() -> None:
    # The upstream saw the request: sending it again could run the generation twice.
    with trio.fail_after(10):
        async with ClosingUpstream(answer=1, partial=True).serving() as upstream:
            lease = _Lease(upstream.port)
            await post_upstream(lease, "/health", {})
            with pytest.raises(UpstreamError):
                await post_upstream(lease, "/health", {})
            await lease.handle.upstream.aclose()
    assert upstream.requests == [(1, "/health"), (1, "/health")]


async def test_a_connection_idle_past_the_keep_time_is_not_reused(mock_clock: trio.testing.MockClock) -> None:
    # llama-server closes a connection idle for 5 s; the pool stops offering it after KEEP_IDLE.
    async with ClosingUpstream(answer=100).serving() as upstream:
        lease = _Lease(upstream.port)
        await post_upstream(lease, "/health", {})
        await post_upstream(lease, "/health", {})
        mock_clock.jump(KEEP_IDLE + 0.1)
        await post_upstream(lease, "/health", {})
        stats = lease.handle.upstream.statistics()
        await lease.handle.upstream.aclose()
    assert [c for c, _ in upstream.requests] == [1, 1, 2]
    assert (stats.opened, stats.reused, stats.retried, upstream.dropped) == (2, 1, 0, 0)


# ------------------------------------------------------------------------------------------
# the answer parser (pure)


def _feed_bytewise(reader: ResponseReader, data: bytes) -> bytes:
    return b"".join(reader.feed(data[i : i + 1]) for i in range(len(data)))


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n"
    b"5\r\nHello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: 1\r\n\r\n"
)


def test_chunked_answer_in_one_piece_and_byte_by_byte() -> None:
    whole = ResponseReader()
    assert whole.feed(CHUNKED) == b"Hello, world" and whole.done and whole.keep_alive
    bytewise = ResponseReader()
    assert _feed_bytewise(bytewise, CHUNKED) == b"Hello, world" and bytewise.done
    assert bytewise.status == 200 and bytewise.headers["keep-alive"] == "timeout=5, max=100"


def test_content_length_and_connection_close() -> None:
    reader = ResponseReader()
    body = reader.feed(b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 4\r\n\r\nnope")
    assert (reader.status, body, reader.done, reader.keep_alive) == (404, b"nope", True, False)


def test_body_until_close_and_eof_errors() -> None:
    reader = ResponseReader()
    assert reader.feed(b"HTTP/1.0 200 OK\r\n\r\nab") == b"ab"
    reader.feed_eof()
    assert reader.done and not reader.keep_alive
    silent = ResponseReader()
    with pytest.raises(ProtocolError, match="without answering"):
        silent.feed_eof()
    cut = ResponseReader()
    cut.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ProtocolError, match="middle of its answer"):
        cut.feed_eof()
    assert cut.received > 0


def test_malformed_answers_are_protocol_errors() -> None:
    for data in (b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        with pytest.raises(ProtocolError):
            ResponseReader().feed(data)


def test_request_head() -> None:
    assert request_head("POST", "/completion", 8080, 2) == (
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
    )
    assert request_head("GET", "/health", 8080, 0) == b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n"
    # another node of a fleet at an IPv6 address: its Host names it in brackets
    assert request_head("GET", "/health", 8080, 0, host="fd00::2") == b"GET /health HTTP/1.1\r\nHost: [fd00::2]:8080\r\n\r\n"


async def test_a_consumer_that_leaves_mid_answer_closes_the_connection() -> None:
    # Cancellation (a client gone) closes the upstream connection: llama-server then stops the
    # generation, and a half-read connection never goes back to the pool.
    with trio.fail_after(10):
        async with ClosingUpstream(answer=100).serving() as upstream:
            pool = UpstreamPool(upstream.port)
            with trio.CancelScope() as scope:
                async with pool.request("POST", "/health", b"{}") as response:
                    assert response.status == 200
                    scope.cancel()
                    await trio.sleep_forever()
            stats = pool.statistics()
            await upstream.one_ended.wait()  # the upstream saw the connection close (fail_after bounds it)
            assert upstream.ended == 1
            await pool.aclose()
    assert (stats.active, stats.idle, stats.opened) == (0, 0, 1)


async def test_a_watched_steps_connection_is_forgotten_when_its_request_ends() -> None:
    # A step on a runner that stalls is ended by closing the connection the pool uses for it;
    # once that request ends, the connection may go back to the pool and to another request.
    with trio.fail_after(10):
        async with ClosingUpstream(answer=100).serving() as upstream:
            pool = UpstreamPool(upstream.port)
            watch = Watched()
            token = watched.set(watch)
            try:
                async with pool.request("POST", "/health", b"{}") as response:
                    assert watch.connection is not None  # noted while its request is under way
                    await response.read()
            finally:
                watched.reset(token)
            assert watch.connection is None
            watch.abort()  # closes nothing now
            status, _ = await pool.post("/health", b"{}")
            stats = pool.statistics()
            await pool.aclose()
    assert status == 200 and stats.reused == 1 and stats.opened == 1

