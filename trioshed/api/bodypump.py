"""Keep reading a request body the application will never read, so the connection can close.

hypercorn hands each request's body to the application through a queue of 10 messages and, when
the response is complete, puts one more (``http.disconnect``) in it. An application that answers
without reading the body (413 for an announced 50 MB body, 401, 503 while draining) leaves that
queue full: the final put blocks, the response never completes on hypercorn's side, the
connection is held forever and never read again (seen: a 413 whose connection stayed open).

:class:`BodyPump` sits between hypercorn and the app: it forwards body messages while the
application may want them and discards them once the response is complete, until hypercorn's
``http.disconnect`` arrives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

Message = dict[str, Any]
DISCONNECT_WAIT = 10.0  # seconds to wait for hypercorn's disconnect after the app finished


class BodyPump:
    def __init__(self, receive: Callable[[], Awaitable[Message]]) -> None:
        self._receive = receive
        # Unbuffered: a message is taken from hypercorn only when the application asks for one.
        self._send_chan, self._recv_chan = trio.open_memory_channel[Message](0)
        self._done = False
        self._forwarding: trio.CancelScope | None = None

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
                if not self._done:
                    with trio.CancelScope() as self._forwarding:
                        await self._send_chan.send(message)
                    self._forwarding = None
                if message["type"] == "http.disconnect":
                    return


async def run_with_pump(
    app: Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]],
    scope: Message,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """Run ``app`` for one HTTP request with a :class:`BodyPump` in front of its ``receive``."""
    pump = BodyPump(receive)

    async def send_through(message: Message) -> None:
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
