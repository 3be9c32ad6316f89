"""The HTTP edge's view of each request: metrics, and one log line per request.

An ASGI wrapper around the app creates a :class:`~trioshed.trace.RequestTrace` per HTTP request
and sets it in the request's context; Quart hooks add the route (the url rule, so labels stay
few) and the status; the scheduler adds the model and the waits; routes add token counts. When
the response has been sent in full (a stream included) or the client has left, the trace becomes
metrics and, with ``TRIOSHED_LOG_FORMAT=json``, one JSON log line on ``trioshed.requests``.

Cost: a contextvar set and reset, two clock reads and a few counter updates per request; nothing
per streamed chunk (the wrapper awaits the app once, it does not wrap ``send``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from trioshed import trace as _trace
from trioshed.api.metrics import CAUSES, Metrics
from trioshed.errors import TrioshedError
from trioshed.trace import RequestTrace

log = logging.getLogger("trioshed.requests")


@contextmanager
def traced(
    scope: Any, metrics: Metrics, *, log_json: bool, finished: Callable[[RequestTrace, float], None] | None = None
) -> Iterator[RequestTrace]:
    """One HTTP request's trace, set for its task; metrics, the log line and ``finished`` (the
    status page's activity) when it ends."""
    trace = RequestTrace(scope["method"], scope["path"], _address(scope.get("client")), time.monotonic())
    token = _trace.current.set(trace)
    try:
        yield trace
    finally:
        _trace.current.reset(token)
        duration = time.monotonic() - trace.started
        metrics.request_finished(trace, duration)
        if finished is not None:
            finished(trace, duration)
        if log_json:
            log.info("request", extra={"fields": log_fields(trace, duration)})
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %d %.1f ms", trace.method, trace.path, trace.status, duration * 1000)


def install(
    app: QuartTrio, metrics: Metrics, *, log_json: bool, finished: Callable[[RequestTrace, float], None] | None = None
) -> None:
    """Wrap ``app``'s ASGI callable and add the hooks; call before other ``before_request``s."""
    inner = app.asgi_app

    async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await inner(scope, receive, send)
            return
        with traced(scope, metrics, log_json=log_json, finished=finished):
            await inner(scope, receive, send)

    app.asgi_app = asgi_app  # type: ignore[method-assign]

    @app.before_request
    async def _route() -> None:
        trace = _trace.current.get()
        if trace is not None and request.url_rule is not None:
            trace.route = request.url_rule.rule

    @app.after_request
    async def _status(response: Response) -> Response:
        trace = _trace.current.get()
        if trace is not None:
            trace.status = response.status_code
        return response


def note_error(exc: TrioshedError) -> None:
    """Remember a refused request's cause (503s are counted by it)."""
    trace = _trace.current.get()
    if trace is not None:
        trace.error = CAUSES.get(type(exc).__name__, type(exc).__name__)


def _address(client: Any) -> str:
    if not client:
        return ""
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def log_fields(trace: RequestTrace, duration: float) -> dict[str, Any]:
    return {
        "event": "request",
        "method": trace.method,
        "path": trace.path,
        "route": trace.route,
        "status": trace.status,
        "model": trace.model or None,
        "queue_wait_ms": _ms(trace.queue_wait),
        "load_wait_ms": _ms(trace.load_wait),
        "prompt_tokens": trace.prompt_tokens,
        "eval_tokens": trace.eval_tokens,
        "duration_ms": _ms(duration),
        "client": trace.client,
        "key": trace.key or None,  # the API key's name, never the key
        "error": trace.error or None,
    }
