"""The serving stack's own floor for a forwarding hop: an ASGI app that does nothing but relay.

``python -m bench.bare_forward --port P --upstream http://127.0.0.1:Q`` serves every request by
sending it on to the upstream and its answer back, under the same HTTP layer as trioshed
(:func:`trioshed.api.pipeline.listener.serve_http`: hypercorn's trio worker with trioshed's connection) and
with the same client (:class:`trioshed.runner.client.UpstreamPool`). It has no gate, no model
lookup, no routing decision, no trace and no log: what a hop through it adds is what hypercorn,
the client and the two extra loopback writes cost, which no forwarding node on this stack can
go under. :mod:`bench.fleet_forward` measures it beside a real trioshed node.
"""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import trio

from bench.floor import lifespan
from trioshed.api.pipeline.listener import ConnectionStats, serve_http
from trioshed.runner.client import UpstreamPool

STREAMS = ("application/x-ndjson", "text/event-stream")


def app_for(pool: UpstreamPool) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        kind = next(
            (v.decode() for k, v in scope["headers"] if k == b"content-type"), "application/json"
        )
        async with pool.request(
            scope["method"], scope["path"], body, content_type=kind
        ) as response:
            answer_kind = response.headers.get("content-type", "application/json")
            head = {"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", answer_kind.encode())]}  # fmt: skip
            if not answer_kind.startswith(STREAMS):
                whole = await response.read()
                await send(head)
                await send({"type": "http.response.body", "body": whole})
                return
            await send(head)
            async for chunk in response.batches():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


async def serve(port: int, upstream: str, streams_keep_alive: bool = True) -> None:
    from trioshed.api.pipeline.listener import hypercorn_config
    from trioshed.config import Settings

    parts = urlsplit(upstream)
    pool = UpstreamPool(
        parts.port or 80, host=parts.hostname or "127.0.0.1", max_idle=64, streams_keep_alive=streams_keep_alive
    )
    config = hypercorn_config(Settings(host="127.0.0.1", port=port))
    await serve_http(
        app_for(pool), config, ConnectionStats(1024), shutdown_trigger=trio.sleep_forever
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--llama-server", action="store_true",
                        help="the upstream is llama-server, which closes a streamed answer's connection (as trioshed's runners)")
    args = parser.parse_args()
    try:
        trio.run(serve, args.port, args.upstream, not args.llama_server)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
