"""The fleet at the HTTP edge: the node-to-node state route, and requests sent to other nodes.

``GET /api/fleet/state`` answers this node's state (:mod:`trioshed.fleet.state`) to a node of the
fleet (the gate checks its signature: :class:`trioshed.fleet.auth.FleetAuth`).

:func:`routed` wraps each route of both serving paths when the node is in a fleet: a
:class:`~trioshed.fleet.node.Forward` raised by the preamble (the one place the decision is
asked) becomes the other node's answer, relayed byte for byte (:class:`RelayedBody`); when every
node it was sent to failed before answering, the route runs again here, served here. A stream
that its node breaks after it started ends with the protocol's own error event.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Blueprint, Response, request

from trioshed import access
from trioshed.api.pipeline.preamble import fast_request, state
from trioshed.api.protocols.errors import error_body, openai_error_event
from trioshed.fleet.auth import serve_here
from trioshed.fleet.node import Forward
from trioshed.fleet.relay import PeerLost, Relayed
from trioshed.fleet.state import to_json
from trioshed.keys import ANONYMOUS, current_key

bp = Blueprint("fleet", __name__)

View = Callable[..., Awaitable[Any]]


@bp.get("/api/fleet/state")
async def fleet_state() -> Any:
    """This node's state, for the other nodes (the gate has checked their signature)."""
    fleet = state().fleet
    if fleet is None:  # the gate refuses first (403); kept for a route reached another way
        return Response(json.dumps({"error": "this node is in no fleet"}), status=404, content_type="application/json")
    local = fleet.local
    return to_json(local.state(trio.current_time()), local.slow.devices)


def routed(view: View) -> View:
    """``view``, sending the request on where the fleet decides (see the module docstring)."""

    @functools.wraps(view)
    async def routed_view(*args: Any, **kwargs: Any) -> Any:
        body = await body_as_sent()  # before the view: parsing a form (a transcription) consumes it
        try:
            return await view(*args, **kwargs)
        except Forward as forward:
            fleet = state().fleet
            assert fleet is not None
            method, path, headers = request_head()
            key = current_key.get()
            relayed = await fleet.relay(forward, None if key is ANONYMOUS else key, method, path, headers, body)
            if relayed is not None:
                return relayed_response(relayed, path)
        token = serve_here.set(True)  # every node it was sent to failed before answering
        try:
            return await view(*args, **kwargs)
        finally:
            serve_here.reset(token)

    return routed_view


async def body_as_sent() -> bytes:
    """The request's body as the client sent it, on either serving path: b"" for a route whose
    requests are never forwarded (nothing is read for them), else read whole and kept (Quart
    parses a form from the kept bytes)."""
    fast = fast_request.get()
    if fast is not None:
        return fast[1]
    if not access.forwarded_route(request.method, request.path):
        return b""
    return await request.get_data(cache=True, as_text=False, parse_form_data=False)


def request_head() -> tuple[str, str, list[tuple[str, str]]]:
    """The request's method, path with its query, and headers, on either serving path."""
    fast = fast_request.get()
    if fast is not None:
        scope = fast[2]
        query = scope.get("query_string") or b""
        path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        return scope["method"], path, headers
    query = request.query_string
    path = request.path + ("?" + query.decode("latin-1") if query else "")
    return request.method, path, list(request.headers.items())


def relayed_response(relayed: Relayed, path: str) -> Response:
    """The other node's answer as this node's (its status, headers and bytes)."""
    body: Any = relayed.first if relayed.whole else RelayedBody(relayed, path)  # a whole answer is sent at once
    response = Response(body, status=relayed.status, content_type=relayed.content_type)
    for name, value in relayed.headers:
        if name.lower() != "content-type":
            response.headers.add(name, value)
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long token streams
    return response


class RelayedBody:
    """The body of a relayed answer: owns the connection to the serving node (closed when the
    body ends, fails or is closed: the client's disconnect cancels the request there) and ends
    a stream its node broke with the protocol's error event."""

    def __init__(self, relayed: Relayed, path: str) -> None:
        self._relayed = relayed
        self._path = path
        self._ended = False
        self._token = trio.lowlevel.current_trio_token()

    def __aiter__(self) -> RelayedBody:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        try:
            chunk = await self._relayed.next_chunk()
        except PeerLost as exc:
            self._ended = True
            await self.aclose()
            return stream_error(self._path, self._relayed.content_type, str(exc))
        except BaseException:
            await self.aclose()
            raise
        if chunk is None:
            await self.aclose()
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._ended = True
        await self._relayed.aclose()

    def __del__(self) -> None:
        # Never started (the client left before the body was entered): close it on the Trio thread.
        if not self._relayed.closed:
            try:
                self._token.run_sync_soon(trio.lowlevel.spawn_system_task, _quietly(self._relayed.aclose))
            except trio.RunFinishedError:
                pass


def _quietly(close: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        try:
            await close()
        except Exception:  # a system task's error would end the run: nothing here is worth that
            pass

    return run


def stream_error(path: str, content_type: str, message: str) -> bytes:
    """The last event of a stream that failed after it started, in its protocol's shape."""
    if content_type.startswith("application/x-ndjson"):
        return json.dumps({"error": message}).encode() + b"\n"
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + json.dumps(error_body(path, 502, message)).encode() + b"\n\n"
    return openai_error_event(502, message)
