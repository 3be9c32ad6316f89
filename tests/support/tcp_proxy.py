"""A TCP proxy for tests: what a client sends through it is recorded (and may be rewritten on
its way), and the way through can be cut, as a network between two machines can."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio


@dataclass
class TcpProxy:
    """Listening on ``port``, forwarding to ``target``. ``sent``: the bytes each connection's
    client sent, in order; ``rewrite``: applied to each piece a client sends before it goes on;
    ``cut()``: every connection closed, new ones refused, until ``mend()``."""

    port: int
    target: tuple[str, int]
    sent: list[bytearray] = field(default_factory=list)
    rewrite: Callable[[bytes], bytes] = lambda data: data
    _open: bool = True
    _scopes: set[trio.CancelScope] = field(default_factory=set)

    def cut(self) -> None:
        self._open = False
        for scope in self._scopes:
            scope.cancel()

    def mend(self) -> None:
        self._open = True

    def requests(self) -> list[bytes]:
        """Every HTTP/1.1 request clients sent through (a head with its Content-Length body),
        in the order each connection sent them."""
        out: list[bytes] = []
        for data in self.sent:
            rest = bytes(data)
            while b"\r\n\r\n" in rest:
                head, _, after = rest.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                out.append(head + b"\r\n\r\n" + after[:length])
                rest = after[length:]
        return out

    async def _serve(self, client: trio.SocketStream) -> None:
        if not self._open:
            await client.aclose()
            return
        record = bytearray()
        self.sent.append(record)
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                server = await trio.open_tcp_stream(*self.target)
            except OSError:
                await client.aclose()
                return
            async with client, server, trio.open_nursery() as nursery:

                async def pipe(source: trio.SocketStream, sink: trio.SocketStream, keep: bytearray | None) -> None:
                    try:
                        while data := await source.receive_some(65536):
                            if keep is not None:
                                data = self.rewrite(data)
                                keep += data
                            await sink.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pipe, client, server, record)
                nursery.start_soon(pipe, server, client, None)
        self._scopes.discard(scope)


@asynccontextmanager
async def open_tcp_proxy(target_port: int, target_host: str = "127.0.0.1") -> AsyncIterator[TcpProxy]:
    """A :class:`TcpProxy` on a free loopback port in front of ``target_host:target_port``."""
    async with trio.open_nursery() as nursery:
        proxy = TcpProxy(0, (target_host, target_port))
        listeners = await nursery.start(partial(trio.serve_tcp, proxy._serve, 0, host="127.0.0.1"))
        proxy.port = listeners[0].socket.getsockname()[1]
        try:
            yield proxy
        finally:
            nursery.cancel_scope.cancel()
