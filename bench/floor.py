"""The inbound floor: hypercorn alone, and quart-trio alone, answering the bench's small POST.

``python -m bench.floor {hypercorn,quart} PORT`` serves ``POST /api/generate`` on 127.0.0.1:PORT
the way trioshed's inbound stack would, with no scheduler and no upstream: read the body, parse
its JSON, and answer a streamed NDJSON body of ``n`` token chunks and a ``done`` chunk (what an
8-token raw generation answers), written at once. ``GET /`` answers 200 (readiness).

* ``hypercorn``: a bare ASGI callable under hypercorn's Trio worker, with trioshed's config.
* ``quart``: a quart-trio app with one route returning a streamed ``Response``, as trioshed's do.

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


async def bare_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A plain ASGI app: no framework at all."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
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
    if len(argv) != 2 or argv[0] not in ("hypercorn", "quart"):
        print("usage: python -m bench.floor {hypercorn,quart} PORT", file=sys.stderr)
        return 2
    app = bare_app if argv[0] == "hypercorn" else quart_app()
    started = time.perf_counter()
    print(f"floor {argv[0]} on port {argv[1]} (import {time.perf_counter() - started:.3f}s)", flush=True)
    trio.run(partial(serve, app, config(int(argv[1]))))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
