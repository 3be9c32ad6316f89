"""The work around every HTTP request, written once for both serving paths.

Two paths serve requests: the Quart app (every route) and the plain-ASGI fast path
(:mod:`trioshed.api.pipeline.fast_path`, the generating routes). Around each request both do the same things
in the same order, by calling one :class:`RequestWrapper`:

1. :meth:`~RequestWrapper.traced`: the request's trace starts (set for its task) and, when the
   request ends, becomes metrics, the log line and the status page's activity
   (:mod:`trioshed.api.observe.request_log`);
2. :meth:`~RequestWrapper.enter`: the route is noted, then the gate (:mod:`trioshed.api.pipeline.gate`)
   checks the Origin, the Host, the API key (or another node's signature), the body's announced
   size and type, and the key's rate and budgets (:meth:`~RequestWrapper.admit`, which the fast
   path calls itself once it knows that it serves the request); a CORS preflight is answered
   204. A key the node does not know is looked for in the shared store before it is refused
   (:meth:`~RequestWrapper.enter_or_look_again`, on the Quart path, where the fast path sends
   every refusal), and a signed request's body is checked once read (:meth:`~RequestWrapper.check_body`);
3. :meth:`~RequestWrapper.on_error`: an error becomes its status, headers and body in the shape
   of the protocol serving the path (:func:`trioshed.api.protocols.errors.error_parts`); a
   refusal's cause is noted for the metrics, an unexpected error is logged and never shown;
4. :meth:`~RequestWrapper.finish`: the answer's status is noted and the CORS headers it carries
   are returned.

The Quart hooks (:func:`trioshed.api.app.create_app`) are thin adapters over these calls and the
fast path calls them directly: a check, header or note added here holds on both paths. Outside
both, around the whole ASGI application, :class:`trioshed.api.pipeline.drain.Drain` guards each request
(graceful drain, bounded upstream waits).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trioshed.api.observe import request_log
from trioshed.api.observe.metrics import Metrics
from trioshed.api.pipeline.gate import Gate, UnknownKey
from trioshed.api.protocols.errors import error_body, error_parts
from trioshed.errors import TrioshedError
from trioshed.fleet.auth import current_signed
from trioshed.keys import ApiKey
from trioshed.trace import RequestTrace
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)

#: A header lookup: case-insensitive name -> the first value, or None.
Headers = Callable[[str], "str | None"]
Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Send], Awaitable[None]]


@dataclass(frozen=True)
class Entry:
    """A request the gate let in: its API key (None without keys, or on a public route), and
    whether it is a CORS preflight (answered 204 at once: browsers send it without credentials)."""

    key: ApiKey | None
    preflight: bool = False


@dataclass(frozen=True)
class ErrorAnswer:
    """The answer to an error: its status, extra headers and JSON body (``application/json``)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class RequestWrapper:
    """What every request goes through, whichever path serves it (see the module docstring).

    One instance per app, shared by the Quart hooks and the fast path.
    """

    def __init__(
        self,
        gate: Gate,
        metrics: Metrics,
        *,
        log_json: bool,
        finished: Callable[[RequestTrace, float], None] | None = None,
    ) -> None:
        self.gate = gate
        self.metrics = metrics
        self.log_json = log_json
        self.finished = finished

    @contextmanager
    def traced(self, scope: Message, send: Send) -> Iterator[Send]:
        """The request's trace, set for its task from here until the request ends (a streamed
        answer included); then its metrics, log line and activity entry. Yields the ``send`` to
        answer with: it ends the trace just before the answer's last part goes out, so that the
        client's next request (``/metrics``, the status page) finds this one counted."""
        with request_log.traced(scope, self.metrics, log_json=self.log_json, finished=self.finished) as observed:

            async def send_and_end(message: Message) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    observed.end()
                await send(message)

            yield send_and_end

    def traced_app(self, app: ASGIApp) -> ASGIApp:
        """``app`` with each HTTP request :meth:`traced` (the Quart app's ASGI callable)."""

        async def traced_app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            with self.traced(scope, send) as traced_send:
                await app(scope, receive, traced_send)

        return traced_app

    def enter(
        self,
        method: str,
        path: str,
        headers: Headers,
        content_length: int | None,
        *,
        route: str | None,
        count: bool = True,
    ) -> Entry:
        """Note the route (the url rule: labels stay few; None: no route matched), then ask the
        gate. Raises the gate's refusal (403, 401, 413, 415, 429).

        ``count=False``: the key's rate and budgets are not counted yet; the caller calls
        :meth:`admit` once it knows that the request goes no other way."""
        trace = current_trace.get()
        if trace is not None and route is not None:
            trace.route = route
        self.gate.check_origin(headers)
        if method == "OPTIONS":
            return Entry(None, preflight=True)
        return Entry(self.gate.check_request(method, path, headers, content_length, count=count))

    async def enter_or_look_again(
        self, method: str, path: str, headers: Headers, content_length: int | None, *, route: str | None
    ) -> Entry:
        """:meth:`enter`, and when the gate refused a key this node does not know, once more after
        the shared store was read (a key made on another node a moment ago: :meth:`Gate.look_again`)."""
        try:
            return self.enter(method, path, headers, content_length, route=route)
        except UnknownKey as unknown:
            if not await self.gate.look_again(unknown):
                raise
        return self.enter(method, path, headers, content_length, route=route)

    def check_body(self, body: bytes) -> None:
        """A request another node signed must carry the body it signed (401 else: changed on its way)."""
        signed = current_signed.get()
        if signed is not None:
            self.gate.fleet.check_body(signed, body)

    def admit(self, entry: Entry, path: str) -> None:
        """Count the request against its key's rate and budgets (after ``enter(count=False)``)."""
        if entry.key is not None:
            self.gate.admit(entry.key)
            self.gate.check_budget(entry.key, path)

    def on_error(self, method: str, path: str, exc: BaseException) -> ErrorAnswer:
        """The answer to ``exc`` in the shape of ``path``'s protocol: a TrioshedError's own
        status and headers (its cause noted for the metrics), a Quart/werkzeug HTTP error's
        status (405 with ``Allow``, 413 with ``Connection: close``), anything else a 500 that
        names only the error's type (logged with its traceback)."""
        if isinstance(exc, HTTPException):
            status = exc.code or 500
            headers: dict[str, str] = {}
            if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
                headers["Allow"] = ", ".join(exc.valid_methods)  # RFC 9110: a 405 says what is
            if status == 413:
                headers["Connection"] = "close"  # a keep-alive client would hang otherwise
            body = json.dumps(error_body(path, status, exc.description or exc.name)).encode()
            return ErrorAnswer(status, headers, body)
        if isinstance(exc, TrioshedError):
            request_log.note_error(exc)
        else:
            log.exception("unhandled error on %s %s", method, path)
        return ErrorAnswer(*error_parts(path, exc))

    def finish(self, headers: Headers, status: int) -> list[tuple[str, str]]:
        """Note the answer's ``status``; the CORS headers it carries (none without an allowed
        Origin)."""
        trace = current_trace.get()
        if trace is not None:
            trace.status = status
        return self.gate.cors(headers)
