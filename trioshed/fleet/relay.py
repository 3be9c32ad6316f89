"""Sending a request on to another node, and its answer back, byte for byte.

:func:`open_relay` tries the nodes it is given in order. A node that cannot be reached, that
breaks the connection before its answer is complete (a whole answer) or before the first chunk
of a stream, or that answers 503 (draining, its queue full), has served nothing: the request
goes to the next node, and when none is left the caller serves it itself. The runner-death rule,
one level up: a request is not lost to a node's death before any of its answer was sent.

A stream's first chunk is awaited before the answer starts, so that the status the client gets
is the serving node's; after that, chunks are passed on as they come (:meth:`Relayed.next_chunk`),
and a node that dies mid-stream raises :class:`PeerLost` for the caller to end the stream with
its protocol's error. Closing a :class:`Relayed` closes the connection to the node, which cancels
the request there (a client's disconnect reaches the serving node's runner).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx
import trio

from trioshed.fleet.auth import HEADERS as FLEET_HEADERS

log = logging.getLogger(__name__)

#: Content types answered as a stream (relayed chunk by chunk); any other answer is read whole
#: before it is passed on.
STREAMS = ("application/x-ndjson", "text/event-stream")
#: Request headers never passed on: hop-by-hop, the length (recomputed), the client's own
#: credentials (the fleet headers carry the key instead) and any fleet header a client forged.
_DROP_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "proxy-authorization", "authorization", "x-api-key", "cookie", "expect"}
) | FLEET_HEADERS  # fmt: skip
#: Answer headers not passed back (the serving path sets its own).
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


class PeerLost(Exception):
    """The serving node broke a stream after it had started."""


@dataclass(frozen=True)
class Target:
    """A node to send the request to."""

    name: str
    url: str


class Relayed:
    """A node's answer, started: its status, headers and first bytes (all of them for a whole
    answer), and, for a stream, the rest (:meth:`next_chunk`). :meth:`aclose` is idempotent."""

    def __init__(
        self,
        node: str,
        status: int,
        headers: list[tuple[str, str]],
        first: bytes,
        response: httpx.Response | None = None,
        rest: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.node = node
        self.status = status
        self.headers = headers
        self.first = first
        self._response = response
        self._rest = rest
        self.on_close: Callable[[], None] | None = None  # called once, when closed
        self.closed = False

    @property
    def content_type(self) -> str:
        return next((v for k, v in self.headers if k.lower() == "content-type"), "application/json")

    async def next_chunk(self) -> bytes | None:
        """The answer's next bytes (the first, then the rest as they come); None at its end;
        PeerLost if the node breaks the stream."""
        if self.first:
            first, self.first = self.first, b""
            return first
        while self._rest is not None:
            try:
                chunk = await self._rest.__anext__()
            except StopAsyncIteration:
                self._rest = None
                return None
            except httpx.HTTPError as exc:
                self._rest = None
                raise PeerLost(f"node {self.node} broke the stream: {exc or type(exc).__name__}") from None
            if chunk:
                return chunk
        return None

    async def aclose(self) -> None:
        self.closed = True
        self._rest = None
        if self._response is not None:
            response, self._response = self._response, None
            with trio.move_on_after(1, shield=True):
                await response.aclose()
        done, self.on_close = self.on_close, None
        if done is not None:
            done()

    @property
    def whole(self) -> bool:
        """Whether the answer is complete already (not a stream)."""
        return self._response is None


def forward_headers(headers: Sequence[tuple[str, str]], fleet: dict[str, str]) -> list[tuple[str, str]]:
    """The request headers a node passes on: the client's, less :data:`_DROP_REQUEST`, plus the
    fleet's own (``fleet``)."""
    kept = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST]
    return kept + list(fleet.items())


async def open_relay(
    client: httpx.AsyncClient,
    targets: Sequence[Target],
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    down: Callable[[str, str], None],
) -> Relayed | None:
    """The first of ``targets`` to answer (see the module docstring); None when every one
    failed before answering. ``down(name, reason)`` is told each node that could not be reached
    or broke the connection. Cancellation: the connection being opened is closed."""
    for target in targets:
        try:
            relayed = await _try(client, target, method, path, headers, body)
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("fleet: node %s failed before answering (%s); trying the next", target.name, reason)
            down(target.name, reason)
            continue
        if relayed is not None:
            return relayed
    return None


async def _try(
    client: httpx.AsyncClient, target: Target, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
) -> Relayed | None:
    """``target``'s answer, started; None when it answered 503 (it takes nothing new)."""
    request = client.build_request(method, target.url + path, headers=list(headers), content=body)
    response = await client.send(request, stream=True)
    try:
        if response.status_code == 503:
            log.info("fleet: node %s answered 503; trying the next", target.name)
            await response.aclose()
            return None
        kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _DROP_RESPONSE]
        kind = response.headers.get("content-type", "")
        if not kind.startswith(STREAMS):
            whole = await response.aread()
            await response.aclose()
            return Relayed(target.name, response.status_code, kept, whole, None)
        rest = response.aiter_raw().__aiter__()
        first = b""
        while not first:
            try:
                first = await rest.__anext__()
            except StopAsyncIteration:
                await response.aclose()
                return Relayed(target.name, response.status_code, kept, b"")
        return Relayed(target.name, response.status_code, kept, first, response, rest)
    except BaseException:
        with trio.move_on_after(1, shield=True):
            await response.aclose()
        raise
