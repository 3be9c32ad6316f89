"""The inbound floor: hypercorn alone, and quart-trio alone, answering the bench's small POST.

``python -m bench.floor {hypercorn,quart,raw} PORT`` serves ``POST /api/generate`` on 127.0.0.1:PORT
the way trioshed's inbound stack would, with no scheduler and no upstream: read the body, parse
its JSON, and answer a streamed NDJSON body of ``n`` token chunks and a ``done`` chunk (what an
8-token raw generation answers), written at once. ``GET /`` answers 200 (readiness).

* ``hypercorn``: a bare ASGI callable under hypercorn's Trio worker, with trioshed's config.
* ``quart``: a quart-trio app with one route returning a streamed ``Response``, as trioshed's do.
* ``raw``: no HTTP library at all, a Trio socket server writing a canned chunked answer: what
  the bench client and loopback cost by themselves (subtract it to get a server's own cost).

Read every trioshed figure against these: whatever trioshed adds per request on top of
``direct`` cannot be less than what its inbound stack costs on this machine.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def answer(body: bytes) -> bytes:
    """The NDJSON a raw generation of ``num_predict`` tokens answers (8 when not given)."""
    request = json.loads(body) if body else {}
    model = request.get("model", "floor")
    n = int((request.get("options") or {}).get("num_predict", 8))
    stamp = "2026-01-01T00:00:00.000000Z"
    lines = [{"model": model, "created_at": stamp, "response": " tok", "done": False} for _ in range(n)]
    lines.append({"model": model, "created_at": stamp, "response": "", "done": True, "done_reason": "length",
                  "eval_count": n, "total_duration": 1})  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def lifespan(receive: Receive, send: Send) -> None:
    """An ASGI lifespan that has nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def bare_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A plain ASGI app: no framework at all."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] == "POST":
        status, content_type, payload = 200, b"application/x-ndjson", answer(body)
    else:
        status, content_type, payload = 200, b"text/plain", b"floor"
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def quart_app() -> Any:
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("floor")
    app.config["RESPONSE_TIMEOUT"] = None

    @app.post("/api/generate")
    async def generate() -> Response:
        payload = answer(await request.get_data(as_text=False))  # type: ignore[arg-type]

        async def body() -> AsyncIterator[bytes]:
            yield payload

        response = Response(body(), content_type="application/x-ndjson")
        response.timeout = None
        return response

    @app.get("/")
    async def root() -> str:
        return "floor"

    return app


async def serve_raw(port: int) -> None:
    """Answer every request on a connection with the canned chunked NDJSON (keep-alive)."""
    canned: dict[bytes, bytes] = {}

    async def connection(stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                body, buffer = buffer[:length], buffer[length:]
                if not head.startswith(b"POST"):
                    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfloor")
                    continue
                if body not in canned:  # the bench sends the same body every time
                    payload = answer(body)
                    canned[body] = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))  # fmt: skip
                await stream.send_all(canned[body])

    await trio.serve_tcp(connection, port, host="127.0.0.1")


def config(port: int) -> Config:
    """trioshed's own hypercorn settings (``trioshed/server.py``)."""
    c = Config()
    c.bind = [f"127.0.0.1:{port}"]
    c.accesslog = None
    c.read_timeout = None
    c.graceful_timeout = 3
    c.keep_alive_timeout = 75
    return c


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("hypercorn", "quart", "raw"):
        print("usage: python -m bench.floor {hypercorn,quart,raw} PORT", file=sys.stderr)
        return 2
    if argv[0] == "raw":
        trio.run(serve_raw, int(argv[1]))
        return 0
    app = bare_app if argv[0] == "hypercorn" else quart_app()
    started = time.perf_counter()
    print(f"floor {argv[0]} on port {argv[1]} (import {time.perf_counter() - started:.3f}s)", flush=True)
    trio.run(partial(serve, app, config(int(argv[1]))))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
