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
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import trio

from trioshed.fleet.auth import HEADERS as FLEET_HEADERS
from trioshed.runner.client import ConnectionFailed, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

#: Content types answered as a stream (relayed chunk by chunk); any other answer is read whole
#: before it is passed on.
STREAMS = ("application/x-ndjson", "text/event-stream")
#: Request headers never passed on: hop-by-hop, the length and type (written apart), the client's own
#: credentials (the fleet headers carry the key's name instead), any fleet header a client forged,
#: and the browser's ``Origin`` (the entry node checked it; the serving node sees a node's request).
_DROP_REQUEST = frozenset(
    {"host", "content-length", "content-type", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "proxy-authorization", "authorization", "x-api-key", "cookie", "expect", "origin"}
) | FLEET_HEADERS  # fmt: skip
#: A header name HTTP allows (a token), and a value the relay writes: visible ASCII and spaces.
_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(r"[\x20-\x7e\t]*")
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
        stack: AsyncExitStack | None = None,
        rest: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.node = node
        self.status = status
        self.headers = headers
        self.first = first
        self._stack = stack  # holds the connection while a stream is relayed
        self._rest = rest
        self.on_close: Callable[[], None] | None = None  # called once, when closed
        self.closed = False

    @property
    def content_type(self) -> str:
        return next((v for k, v in self.headers if k.lower() == "content-type"), "application/json")

    @property
    def whole(self) -> bool:
        """Whether the answer is complete already (not a stream)."""
        return self._stack is None

    async def next_chunk(self) -> bytes | None:
        """The answer's next bytes (the first, then the rest as they come); None at its end;
        PeerLost if the node breaks the stream."""
        if self.first:
            first, self.first = self.first, b""
            return first
        if self._rest is None:
            return None
        try:
            return await self._rest.__anext__()
        except StopAsyncIteration:
            self._rest = None
            return None
        except ConnectionFailed as exc:
            self._rest = None
            raise PeerLost(f"node {self.node} broke the stream: {exc}") from None

    async def aclose(self) -> None:
        self.closed = True
        self._rest = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with trio.move_on_after(1, shield=True):
                await stack.aclose()  # an answer not read to its end closes its connection
        done, self.on_close = self.on_close, None
        if done is not None:
            done()


def forward_headers(headers: Sequence[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
    """The content type and the other request headers a node passes on: the client's, less
    :data:`_DROP_REQUEST` and less any whose name or value is not plain ASCII (``User-Agent: café``
    is dropped, not a failed relay); the fleet's own headers are added per node by the caller."""
    kind = next((v for k, v in headers if k.lower() == "content-type"), "application/json")
    if not _VALUE.fullmatch(kind):
        kind = "application/octet-stream"
    kept = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST and _NAME.fullmatch(k) and _VALUE.fullmatch(v)]
    return kind, kept


async def open_relay(
    pool: UpstreamPool,
    target: Target,
    method: str,
    path: str,
    content_type: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
) -> Relayed | None:
    """``target``'s answer, started (see the module docstring); None when it answered 503 (it
    takes nothing new). Raises ConnectionFailed when it failed before answering. Cancellation:
    the connection being used is closed."""
    stack = AsyncExitStack()
    try:
        response: UpstreamResponse = await stack.enter_async_context(
            pool.request(method, path, body, content_type=content_type, headers=headers)
        )
        if response.status == 503:
            log.info("fleet: node %s answered 503; trying the next", target.name)
            await stack.aclose()
            return None
        kept = [(k, v) for k, v in response.headers.items() if k not in _DROP_RESPONSE]
        if not response.headers.get("content-type", "").startswith(STREAMS):
            whole = await response.read()
            status = response.status
            await stack.aclose()
            return Relayed(target.name, status, kept, whole)
        rest = response.batches()
        stack.push_async_callback(rest.aclose)
        try:
            first = await rest.__anext__()
        except StopAsyncIteration:
            await stack.aclose()
            return Relayed(target.name, response.status, kept, b"")
        return Relayed(target.name, response.status, kept, first, stack, rest)
    except BaseException:
        with trio.move_on_after(1, shield=True):
            await stack.aclose()
        raise
