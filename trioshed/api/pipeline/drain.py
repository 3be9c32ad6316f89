"""Graceful drain and bounded upstream waits: the requests in flight, as the ASGI layer sees them.

:class:`Drain` wraps the Quart app (an ASGI callable). Every HTTP request runs inside a
:class:`RequestGuard` (a cancel scope plus the state of its current upstream wait), found by the
upstream code through a context variable. ``serve()`` drives the shutdown:

1. ``begin()``: new requests are answered 503 with ``Retry-After`` (at the ASGI layer, before
   Quart), requests in flight go on;
2. ``wait_idle()`` for up to ``TRIOSHED_SHUTDOWN_TIMEOUT`` (a second signal, ``force()``, ends it);
3. ``cut()``: every guarded upstream wait raises :class:`ShuttingDown`, so a stream ends with its
   final error line and a plain answer becomes a 503; after a short grace what is left is cancelled.

The same guard bounds each upstream wait by ``TRIOSHED_STREAM_IDLE_TIMEOUT``: a runner that sends
nothing for that long (hung, not dead) ends the request with :class:`RunnerStalled`. A wait that
can be ended from outside (a read of an answer: its connection is closed) is watched by the
drain's one watchdog task (:meth:`Drain.watch`), at the cost of noting when it began: a cancel
scope per read was a fifth of a short request's own cost. Any other wait (an answer's head, a
slot restore) runs in a cancel scope with the bound as its deadline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import trio
from trio_util import RepeatedEvent

from trioshed.api.pipeline.bodypump import run_with_pump
from trioshed.api.protocols.errors import error_body
from trioshed.errors import RunnerStalled, ShuttingDown, TrioshedError

T = TypeVar("T")
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]

class FastApp(Protocol):
    """The fast path (:class:`trioshed.api.pipeline.fast_path.FastPath`): what it serves runs in scopes it
    takes from the request's guard itself (:meth:`RequestGuard.new_scope`)."""

    def wants(self, scope: dict[str, Any]) -> bool: ...
    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None: ...


_current: ContextVar[RequestGuard | None] = ContextVar("trioshed_request_guard", default=None)
CUT_GRACE = 2.0  # seconds for cut requests to write their final line before they are cancelled


class RequestGuard:
    """One request in flight: its cancel scope, and the upstream wait it is in (if any)."""

    def __init__(self, idle_timeout: float, draining: trio.Event | None = None, *, watched: bool = False) -> None:
        self.idle_timeout = idle_timeout
        self.draining = trio.Event() if draining is None else draining  # set when the server drains
        #: the scope the request runs in (:meth:`new_scope`; the fast path enters its own)
        self.scope: trio.CancelScope | None = None
        self._cancelled = False
        #: a watchdog (:meth:`Drain.watch`) ends this request's abortable waits that stall
        self.watched = watched
        self._stop: TrioshedError | None = None
        self._waiting: trio.CancelScope | None = None
        self.since: float | None = None  # when the abortable wait under way began
        self._abort: Callable[[], None] | None = None
        self._stalled = False

    async def bounded(self, step: Callable[[], Awaitable[T]], what: str, abort: Callable[[], None] | None = None) -> T:
        """``await step()`` unless the request is cut (raises its error) or ``step`` takes longer
        than the idle timeout (raises RunnerStalled naming ``what``).

        ``abort``: makes ``step`` fail at once (closes the connection it reads); given, and the
        request watched, the watchdog calls it instead of a cancel scope bounding the wait.

        Cancellation: only this wait is cancelled or aborted; the caller's scopes are untouched.
        """
        if self._stop is not None:
            raise self._stop
        if abort is not None and self.watched:
            self.since, self._abort = trio.current_time(), abort
            try:
                got = await step()
            except Exception:
                self._raise_ended(what)
                raise
            finally:
                self.since = self._abort = None
            self._raise_ended(what)  # aborted as its answer came: the connection is closed, no more follows
            return got
        with trio.CancelScope(deadline=trio.current_time() + self.idle_timeout) as scope:
            self._waiting = scope
            try:
                return await step()
            finally:
                self._waiting = None
        if self._stop is not None:
            raise self._stop
        raise RunnerStalled(what, self.idle_timeout)

    def _raise_ended(self, what: str) -> None:
        if self._stop is not None:
            raise self._stop from None
        if self._stalled:
            self._stalled = False
            raise RunnerStalled(what, self.idle_timeout) from None

    def new_scope(self, deadline: float = math.inf) -> trio.CancelScope:
        """The scope for the request's work from here (a scope is entered once: a part that runs
        after another gets its own), cancelled at once if the request was cancelled already."""
        self.scope = trio.CancelScope(deadline=deadline)
        if self._cancelled:
            self.scope.cancel(reason="shutdown: drain timeout")
        return self.scope

    def cancel(self) -> None:
        """Cancel what the request runs now, and any part it runs later."""
        self._cancelled = True
        if self.scope is not None:
            self.scope.cancel(reason="shutdown: drain timeout")

    def stall(self) -> None:
        """The abortable wait under way stalled (the watchdog's call): abort it."""
        if self._abort is not None:
            self._stalled = True
            self._abort()

    def stop(self, error: TrioshedError) -> None:
        """Make the current and every later upstream wait raise ``error``."""
        self._stop = error
        if self._waiting is not None:
            self._waiting.cancel(reason="request cut")
        if self._abort is not None:
            self._abort()


def current_guard() -> RequestGuard | None:
    """The current request's guard (None outside a drained app)."""
    return _current.get()


def drain_started() -> trio.Event | None:
    """Set once the server drains (None outside a drained app): a stream that would otherwise
    run forever (``GET /api/events``) ends on it, so that it does not hold up the shutdown."""
    guard = _current.get()
    return None if guard is None else guard.draining


async def bounded(step: Callable[[], Awaitable[T]], what: str, abort: Callable[[], None] | None = None) -> T:
    """:meth:`RequestGuard.bounded` for the current request (unbounded outside one)."""
    guard = _current.get()
    if guard is None:
        return await step()
    return await guard.bounded(step, what, abort)


class Drain:
    """The ASGI wrapper counting requests in flight; see the module docstring for the sequence."""

    def __init__(self, app: ASGIApp, *, idle_timeout: float, retry_after: int = 5, fast: FastApp | None = None) -> None:
        self.app = app
        #: serves each request in place of ``run_with_pump(app)`` (trioshed.api.pipeline.fast_path), if given
        self.fast = fast
        self.idle_timeout = idle_timeout
        self.retry_after = retry_after
        self.draining = False
        self.requested = trio.Event()  # a shutdown was asked for (signal, or a test)
        self.forced = trio.Event()  # a second signal: stop waiting
        self.started = trio.Event()  # begin() was called: endless streams end
        self._inflight: set[RequestGuard] = set()
        self._changed = RepeatedEvent()
        self._watching = False  # the watchdog runs (:meth:`watch`)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await run_with_pump(self._refuse, scope, receive, send)
            return
        guard = RequestGuard(self.idle_timeout, self.started, watched=self._watching)
        token = _current.set(guard)
        self._inflight.add(guard)
        try:
            if self.fast is None:
                with guard.new_scope():
                    await run_with_pump(self.app, scope, receive, send)
            elif self.fast.wants(scope):
                await self.fast(scope, receive, send)  # in the guard's scopes (FastPath._serve)
            else:
                with guard.new_scope():
                    await self.fast(scope, receive, send)
        finally:
            self._inflight.discard(guard)
            _current.reset(token)
            if self.draining:  # only the drain waits for requests to end
                self._changed.set()

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The watchdog, until cancelled: aborts each abortable upstream wait that has gone on for
        the idle timeout, at that moment (it sleeps until the oldest wait's bound, or for the
        timeout when none is under way: a wait that begins meanwhile cannot stall sooner)."""
        self._watching = True
        task_status.started()
        try:
            while True:
                now = trio.current_time()
                wake = now + self.idle_timeout
                for guard in self._inflight:
                    since = guard.since
                    if since is None:
                        continue
                    if now - since >= self.idle_timeout:
                        guard.stall()
                    else:
                        wake = min(wake, since + self.idle_timeout)
                await trio.sleep_until(wake)
        finally:
            self._watching = False

    async def _refuse(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        body = json.dumps(error_body(scope.get("path", ""), ShuttingDown.status, ShuttingDown().message)).encode()
        await send({
            "type": "http.response.start",
            "status": ShuttingDown.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(self.retry_after).encode()),
                (b"connection", b"close"),
            ],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def request_shutdown(self) -> None:
        """First signal: start the drain. Later ones: stop waiting for requests in flight."""
        if self.requested.is_set():
            self.forced.set()
        self.requested.set()

    def begin(self) -> None:
        self.draining = True
        self.started.set()

    async def wait_idle(self) -> None:
        """Until no request is in flight or ``forced``."""
        while self._inflight and not self.forced.is_set():
            with trio.move_on_after(0.5):  # also re-checks ``forced`` twice a second
                await self._changed.wait()

    async def cut(self, grace: float = CUT_GRACE) -> None:
        """End what is still in flight: guarded waits raise ShuttingDown, then (after ``grace``)
        whatever has not finished is cancelled."""
        for guard in list(self._inflight):
            guard.stop(ShuttingDown())
        with trio.move_on_after(grace):
            while self._inflight:
                await self._changed.wait()
        for guard in list(self._inflight):
            guard.cancel()
