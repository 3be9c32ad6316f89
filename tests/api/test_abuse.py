"""HTTP abuse with bounds: slow headers, hundreds of idle connections, a 100 KB request line, an
endless chunked body, clients resetting mid-stream. After each, a normal request succeeds at once
and no lease is held. Real clock, ``fail_after`` guards."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from trioshed.server import Server
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

IDLE = 2.0  # TRIOSHED_HTTP_IDLE_TIMEOUT in these tests
LIMITS = {"http_idle_timeout": IDLE, "max_connections": 64, "max_body": 1 << 20}


def port_of(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


async def assert_healthy(server: Server) -> None:
    """A normal request answers at once, and nothing is leased or queued."""
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as http:
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200 and r.json()["done"] is True
    stats = server.scheduler.statistics()
    assert stats.leased == 0 and stats.queued == 0


@asynccontextmanager
async def abused_server(model_store: Path) -> AsyncIterator[Server]:
    with trio.fail_after(120):
        async with open_test_server(model_store, **LIMITS) as server:
            await assert_healthy(server)  # loads the runner first
            yield server
            await assert_healthy(server)


async def poll_until(predicate: Callable[[], bool]) -> None:
    while True:
        if predicate():
            return
        await trio.sleep(0.05)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = bytearray()
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return bytes(data)


async def test_slow_headers_are_cut_off_after_the_idle_timeout(model_store: Path) -> None:
    async with abused_server(model_store) as server:
        closed_after: list[float] = []

        async def slowloris() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
            started = trio.current_time()
            async with stream:
                try:
                    for byte in b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 1000:
                        await stream.send_all(bytes([byte]))
                        with trio.move_on_after(0.2):
                            if await stream.receive_some(1) == b"":
                                break
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            closed_after.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(slowloris)
            await trio.sleep(0.5)
            await assert_healthy(server)  # served while they trickle
        assert len(closed_after) == 20 and max(closed_after) < IDLE + 5, closed_after


async def test_hundreds_of_idle_connections_are_bounded(model_store: Path) -> None:
    async with abused_server(model_store) as server:
        streams: list[trio.SocketStream] = []

        async def connect() -> None:
            with trio.move_on_after(3):
                streams.append(await trio.open_tcp_stream("127.0.0.1", port_of(server)))

        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(connect)
        await trio.sleep(0.5)
        assert len(streams) >= 150  # the kernel's backlog holds what the server has not accepted
        assert server.connections.open == server.connections.limit == 64
        # the idle timeout frees slots: the server works through the idle crowd by itself
        with trio.fail_after(60):
            await poll_until(lambda: server.connections.accepted > 64 + 64)
        assert server.connections.open <= 64
        for stream in streams:
            await stream.aclose()
        with trio.fail_after(10):
            await poll_until(lambda: server.connections.open == 0)


async def test_a_100_kb_request_line_is_refused_and_closed(model_store: Path) -> None:
    async with abused_server(model_store) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
        async with stream:
            with trio.fail_after(10):
                try:
                    await stream.send_all(b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
                except trio.BrokenResourceError:
                    pass
                answer = await read_until_closed(stream)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert b"connection: close" in answer.lower()


async def test_an_endless_chunked_body_is_cut_at_the_body_limit(model_store: Path) -> None:
    async with abused_server(model_store) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
        sent = 0

        async def endless() -> None:
            nonlocal sent
            chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
            await stream.send_all(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                while True:
                    await stream.send_all(chunk)
                    sent += 65536
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(endless)
            with trio.fail_after(30):
                answer = await read_until_closed(stream)
            nursery.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"connection: close" in answer.lower()
        assert sent < 64 * LIMITS["max_body"]  # stopped, not read forever


def reset(sock: trio.SocketStream) -> None:
    """Close with RST instead of FIN (SO_LINGER 0): a client that crashed or was killed."""
    sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_clients_resetting_mid_stream_release_their_leases(model_store: Path) -> None:
    async with abused_server(model_store) as server:
        body = json.dumps({"model": "tiny", "prompt": "hi", "options": {"num_predict": 1000, "temperature": 1}}).encode()
        request = b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        for _ in range(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
            await stream.send_all(request)
            with trio.fail_after(30):
                first = await stream.receive_some(4096)
            assert first.startswith(b"HTTP/1.1 200")
            reset(stream)
            await stream.aclose()
        with trio.fail_after(10):
            await server.scheduler.wait_statistics(lambda s: s.leased == 0)
