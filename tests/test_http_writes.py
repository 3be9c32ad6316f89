"""The HTTP listener's writes: a response's head goes out with the first bytes of its body, in
one write (hypercorn alone wrote it by itself: one more packet and one more wake-up of the client
per response), and an interim ``100 Continue`` is never held back. A write the socket takes
whole is made at once; one it cannot take waits (hypercorn's own write), in order, whole."""

from __future__ import annotations

import logging
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

from trioshed.api.http import _Connection, hypercorn_config
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
