"""The HTTP listener's writes: a response's head goes out with the first bytes of its body, in
one write (hypercorn alone wrote it by itself: one more packet and one more wake-up of the client
per response), and an interim ``100 Continue`` is never held back. A write the socket takes
whole is made at once; one it cannot take waits (hypercorn's own write), in order, whole."""

from __future__ import annotations

import logging
import re
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from trioshed.api.pipeline.listener import BODY, _Connection, hypercorn_config
from trioshed.config import Settings


class Recording(trio.abc.HalfCloseableStream):
    """The server's side of a real TCP connection, recording what each write carried."""

    def __init__(self, socket: trio.socket.SocketType) -> None:
        self.inner = trio.SocketStream(socket)
        self.socket = socket
        self.writes: list[bytes] = []  # every write, in order
        self.inner_writes: list[bytes] = []  # those that went through send_all (which waits)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        self.inner_writes.append(bytes(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class RecordingConnection(_Connection):
    """The listener's connection, recording the writes it makes at once as well."""

    recording: Recording

    def _write_now(self, data: bytes) -> int:
        sent = super()._write_now(data)
        self.recording.writes.append(bytes(data[:sent]))
        return sent


BIG = 8 << 20  # far more than a loopback socket's buffers hold


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    if scope["path"] == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(BIG).encode())]})
        for i in range(BIG // 65536):
            await send({"type": "http.response.body", "body": bytes([i % 251]) * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        await send({"type": "http.response.body", "body": b" world", "more_body": False})
        return
    if scope["path"] in ("/parts", "/parts-as-messages"):  # the same answer, its parts written two ways
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"hello", b"", b" wide", b" " + b"w" * 300):
            if scope["path"] == "/parts":
                await scope["extensions"][BODY](part)
            else:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b" world", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body) + 3).encode())]})
    await send({"type": "http.response.body", "body": b"ok " + body, "more_body": False})


@asynccontextmanager
async def connection() -> AsyncIterator[tuple[trio.SocketStream, Recording]]:
    """A client stream connected over loopback TCP to a listener connection serving :func:`app`."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket()
    async with trio.open_nursery() as nursery:
        await client.connect(listener.getsockname())
        accepted, _ = await listener.accept()
        server = Recording(accepted)
        config = hypercorn_config(Settings.from_env({"TRIOSHED_MODELS": "/nonexistent"}))
        served = RecordingConnection(wrap_app(app, config.wsgi_max_body_size, "asgi"), config, WorkerContext(None), ConnectionState({}), server)  # type: ignore[arg-type]
        served.recording = server
        nursery.start_soon(served.run)
        async with trio.SocketStream(client) as stream:
            yield stream, server
        nursery.cancel_scope.cancel()
    listener.close()


async def read_until(stream: trio.SocketStream, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        data += await stream.receive_some(65536)
    return data


async def test_a_whole_answer_is_one_write() -> None:
    with trio.fail_after(10):
        async with connection() as (client, server):
            await client.send_all(b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            answer = await read_until(client, b"ok hi")
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert len(server.writes) in (1, 2) and server.writes[0] == answer  # (2: the empty end, if written)
    assert b"".join(server.writes[1:]) == b""


async def test_a_streams_head_goes_out_with_its_first_chunk() -> None:
    with trio.fail_after(10):
        async with connection() as (client, server):
            await client.send_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await read_until(client, b"0\r\n\r\n")
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head.lower()
    assert server.writes[0] == head + b"\r\n\r\n5\r\nhello\r\n"
    assert b"".join(server.writes) == answer


async def test_an_interim_100_continue_is_not_held_back() -> None:
    # The client waits for "100 Continue" before it sends the body: held, both would wait.
    with trio.fail_after(10):
        async with connection() as (client, server):
            await client.send_all(b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            interim = await read_until(client, b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100 ")
            await client.send_all(b"hi")
            answer = await read_until(client, b"ok hi")
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert server.writes[0] == interim


async def test_an_answer_larger_than_the_socket_takes_arrives_whole_and_in_order() -> None:
    # The client reads slowly: the server's writes fill the socket, and those wait their turn.
    with trio.fail_after(30):
        async with connection() as (client, server):
            await client.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while len(answer.partition(b"\r\n\r\n")[2]) < BIG:
                answer += await client.receive_some(65536)
                await trio.sleep(0.0005)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b"".join(bytes([i % 251]) * 65536 for i in range(BIG // 65536))
    assert b"".join(server.writes) == answer
    assert server.inner_writes  # some waited (hypercorn's write): not only writes taken at once


async def test_a_client_that_resets_mid_answer_ends_the_connection_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(30):
        async with connection() as (client, server):
            await client.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            await client.receive_some(65536)
            client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.socket.close()  # RST: the server's next write fails
            while server.inner.socket.fileno() != -1:  # noqa: ASYNC110 (the connection closes in its own task)
                await trio.sleep(0.01)
    assert sum(map(len, server.writes)) < BIG
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def _without_date(answer: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"", answer)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_parts_written_by_the_body_writer_are_the_bytes_of_body_messages(version: str) -> None:
    # chunked for HTTP/1.1; as they are (the end is the close) for HTTP/1.0, as h11 frames them
    answers = []
    for path in ("/parts", "/parts-as-messages"):
        with trio.fail_after(10):
            async with connection() as (client, server):
                await client.send_all(f"GET {path} HTTP/{version}\r\nHost: x\r\n\r\n".encode())
                answer = b""
                while not answer.endswith(b"0\r\n\r\n" if version == "1.1" else b" world"):
                    answer += await client.receive_some(65536)
                answers.append((_without_date(answer), len(server.writes)))
    assert answers[0] == answers[1]
    body = answers[0][0].partition(b"\r\n\r\n")[2]
    if version == "1.1":
        assert body == b"5\r\nhello\r\n5\r\n wide\r\n12d\r\n " + b"w" * 300 + b"\r\n6\r\n world\r\n0\r\n\r\n"
    else:
        assert body == b"hello wide " + b"w" * 300 + b" world"


# ---------------------------------------------------------------- the keep-alive timer
# Over a Unix socket pair (what one end writes is readable at the other at once) and Trio's
# MockClock, which jumps only while every task waits: the timings below are exact.

IDLE = 30.0  # the keep-alive timeout in these tests (virtual seconds)


async def paced(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """:func:`app`, and ``/slow``: an answer that takes ``2 * IDLE`` between its two parts."""
    if scope["type"] == "http" and scope["path"] == "/slow":
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"slow", "more_body": True})
        await trio.sleep(2 * IDLE)
        await send({"type": "http.response.body", "body": b" answer", "more_body": False})
        return
    await app(scope, receive, send)


@asynccontextmanager
async def paired(context: WorkerContext | None = None) -> AsyncIterator[trio.SocketStream]:
    """A client stream to a listener connection serving :func:`paced`, keep-alive ``IDLE``."""
    ours, theirs = trio.socket.socketpair()
    config = hypercorn_config(Settings.from_env({"TRIOSHED_MODELS": "/nonexistent"}))
    config.keep_alive_timeout = IDLE
    served = _Connection(
        wrap_app(paced, config.wsgi_max_body_size, "asgi"), config, context or WorkerContext(None), ConnectionState({}),
        trio.SocketStream(theirs),  # type: ignore[arg-type]
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served.run)
        async with trio.SocketStream(ours) as stream:
            yield stream
        # the client closed: the connection's task ends by itself (its timer with it)


async def ask(stream: trio.SocketStream, path: str = "/whole") -> bytes:
    await stream.send_all(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi".encode())
    return await read_until(stream, b"ok hi" if path == "/whole" else b"0\r\n\r\n")


async def closed_after(stream: trio.SocketStream) -> float:
    """Seconds until the server closes the connection (nothing else may arrive)."""
    started = trio.current_time()
    assert await stream.receive_some(65536) == b""
    return trio.current_time() - started


async def test_an_idle_connection_closes_at_its_keep_alive_deadline(autojump_clock: trio.testing.MockClock) -> None:
    async with paired() as client:
        await ask(client)
        assert await closed_after(client) == pytest.approx(IDLE)


async def test_each_answer_starts_the_keep_alive_timer_again(autojump_clock: trio.testing.MockClock) -> None:
    async with paired() as client:
        for _ in range(4):  # 4 * 0.75 * IDLE on one connection: more than IDLE in all
            assert (await ask(client)).startswith(b"HTTP/1.1 200 ")
            await trio.sleep(0.75 * IDLE)
        await ask(client)
        assert await closed_after(client) == pytest.approx(IDLE)


async def test_headers_that_do_not_arrive_in_time_close_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    async with paired() as client:
        await client.send_all(b"POST /whole HTTP/1.1\r\nHost: x\r\n")  # and no more
        assert await closed_after(client) == pytest.approx(IDLE)


async def test_an_answer_longer_than_the_keep_alive_timeout_is_not_cut(autojump_clock: trio.testing.MockClock) -> None:
    async with paired() as client:
        answer = await ask(client, "/slow")
        assert b"slow" in answer and b" answer" in answer
        assert await closed_after(client) == pytest.approx(IDLE)


async def test_a_shutdown_closes_an_idle_connection_at_once(autojump_clock: trio.testing.MockClock) -> None:
    context = WorkerContext(None)
    async with paired(context) as client:
        await ask(client)
        await trio.sleep(1)
        await context.terminated.set()
        assert await closed_after(client) == 0


async def test_a_shutdown_lets_the_answer_under_way_end_then_closes(autojump_clock: trio.testing.MockClock) -> None:
    context = WorkerContext(None)
    async with paired(context) as client:
        await client.send_all(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        await read_until(client, b"slow\r\n")
        await context.terminated.set()
        assert (await read_until(client, b"0\r\n\r\n")).endswith(b" answer\r\n0\r\n\r\n")
        assert await closed_after(client) == 0


class Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def test_the_keep_alive_timer_costs_no_task_per_request(autojump_clock: trio.testing.MockClock) -> None:
    spawns = Spawns()
    async with paired() as client:
        await ask(client)  # the connection's tasks have started
        trio.lowlevel.add_instrument(spawns)
        try:
            for _ in range(10):
                await ask(client)
        finally:
            trio.lowlevel.remove_instrument(spawns)
    assert spawns.spawned == 10  # one for each request's app (hypercorn's), none for the timer
