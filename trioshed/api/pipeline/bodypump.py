"""Keep reading a request body the application will never read, so the connection can close.

hypercorn hands each request's body to the application through a queue of 10 messages and, when
the response is complete, puts one more (``http.disconnect``) in it. An application that answers
without reading the body (413 for an announced 50 MB body, 401, 503 while draining) leaves that
queue full: the final put blocks, the response never completes on hypercorn's side, the
connection is held forever and never read again (seen: a 413 whose connection stayed open).

:class:`BodyPump` sits between hypercorn and the app: it forwards body messages while the
application may want them and discards them once the response is complete, until hypercorn's
``http.disconnect`` arrives.

It also keeps keep-alive honest. An answer that starts before the request body was received in
full (a 401 decided from the headers while the body's segment is still in flight) made hypercorn
close the connection after the response, although the response did not say so: the client's next
request on that connection failed with "Server disconnected without sending a response". So when
the response starts early, a small rest of the body (at most :data:`LINGER_BYTES`, announced) is
read and discarded first; otherwise the response says ``Connection: close``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

Message = dict[str, Any]
DISCONNECT_WAIT = 10.0  # seconds to wait for hypercorn's disconnect after the app finished
LINGER_BYTES = 1 << 20  # an announced body up to this size is received before an early answer
LINGER_SECONDS = 2.0  # ... for at most this long


class BodyPump:
    def __init__(self, receive: Callable[[], Awaitable[Message]]) -> None:
        self._receive = receive
        # Unbuffered: a message is taken from hypercorn only when the application asks for one.
        self._send_chan, self._recv_chan = trio.open_memory_channel[Message](0)
        self._done = False
        self._discard_body = False
        self._forwarding: trio.CancelScope | None = None
        self.body_received = trio.Event()  # the last http.request message came

    async def receive(self) -> Message:
        """The application's ``receive``."""
        try:
            return await self._recv_chan.receive()
        except trio.EndOfChannel:
            if self._done:
                # The response is complete and hypercorn is closing the connection from inside
                # the application's last send. A disconnect now makes quart-trio cancel that
                # send, and with it the close (seen: 413s whose connection stayed open).
                await trio.sleep_forever()
            return {"type": "http.disconnect"}

    def discard_body(self) -> None:
        """The application answers without (the rest of) the body: stop handing it over."""
        self._discard_body = True
        if self._forwarding is not None:
            self._forwarding.cancel(reason="body not wanted")

    def response_complete(self) -> None:
        """From now on, body messages are discarded (nobody will read them)."""
        self._done = True
        if self._forwarding is not None:
            self._forwarding.cancel(reason="response complete")

    async def run(self) -> None:
        """Until hypercorn says ``http.disconnect``."""
        with self._send_chan:
            while True:
                message = await self._receive()
                if message["type"] == "http.request":
                    if not message.get("more_body", False):
                        self.body_received.set()
                    if self._discard_body:
                        continue
                if not self._done:
                    with trio.CancelScope() as self._forwarding:
                        await self._send_chan.send(message)
                    self._forwarding = None
                if message["type"] == "http.disconnect":
                    return


def _announced_length(scope: Message) -> int | None:
    """The body's size from the headers: Content-Length, 0 for none, None when chunked."""
    headers = {name.lower(): value for name, value in scope.get("headers", [])}
    if b"transfer-encoding" in headers:
        return None
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return None


async def _answer_early(pump: BodyPump, scope: Message, start: Message) -> Message:
    """The response starts before the whole body came: receive a small rest, else say close."""
    pump.discard_body()
    length = _announced_length(scope)
    if length is not None and length <= LINGER_BYTES:
        with trio.move_on_after(LINGER_SECONDS):
            await pump.body_received.wait()
    if pump.body_received.is_set():
        return start
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"connection"]
    return {**start, "headers": [*headers, (b"connection", b"close")]}


async def run_with_pump(
    app: Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]],
    scope: Message,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """Run ``app`` for one HTTP request with a :class:`BodyPump` in front of its ``receive``."""
    pump = BodyPump(receive)

    async def send_through(message: Message) -> None:
        if message["type"] == "http.response.start" and not pump.body_received.is_set():
            message = await _answer_early(pump, scope, message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            pump.response_complete()
        await send(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        try:
            await app(scope, pump.receive, send_through)
        finally:
            pump.response_complete()
            nursery.cancel_scope.deadline = trio.current_time() + DISCONNECT_WAIT
