"""The HTTP edge's view of each request: metrics, and one log line per request.

The request wrapper (:mod:`trioshed.api.pipeline.wrapper`, on both serving paths) opens :func:`traced`
around each HTTP request: it creates a :class:`~trioshed.trace.RequestTrace` and sets it in the
request's context; the wrapper adds the route (the url rule, so labels stay few) and the
status; the scheduler adds the model and the waits; routes add token counts. When the response
is about to send the last part of its answer (a stream included: before the client can see its
end, so that a client's next request, ``/metrics`` say, finds it counted) or the client has left,
the trace becomes metrics and, with ``TRIOSHED_LOG_FORMAT=json``, one JSON log line on
``trioshed.requests``.

Cost: a contextvar set and reset, two clock reads and a few counter updates per request; per
streamed chunk, one test of the ASGI message (:meth:`trioshed.api.pipeline.wrapper.RequestWrapper.traced`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trioshed import trace as _trace
from trioshed.api.observe.metrics import CAUSES, Metrics
from trioshed.errors import TrioshedError
from trioshed.trace import RequestTrace

log = logging.getLogger("trioshed.requests")


class Observed:
    """One HTTP request's trace and what becomes of it when the request ends (:meth:`end`)."""

    __slots__ = ("_ended", "_finished", "_log_json", "_metrics", "trace")

    def __init__(
        self, scope: Any, metrics: Metrics, *, log_json: bool, finished: Callable[[RequestTrace, float], None] | None
    ) -> None:
        self.trace = RequestTrace(scope["method"], scope["path"], _address(scope.get("client")), time.monotonic())
        self._metrics, self._log_json, self._finished = metrics, log_json, finished
        self._ended = False

    def end(self) -> None:
        """The request ended: its metrics, the log line and ``finished`` (the status page's
        activity). Once; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        trace = self.trace
        duration = time.monotonic() - trace.started
        self._metrics.request_finished(trace, duration)
        if self._finished is not None:
            self._finished(trace, duration)
        if self._log_json:
            log.info("request", extra={"fields": log_fields(trace, duration)})
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %d %.1f ms", trace.method, trace.path, trace.status, duration * 1000)


@contextmanager
def traced(
    scope: Any, metrics: Metrics, *, log_json: bool, finished: Callable[[RequestTrace, float], None] | None = None
) -> Iterator[Observed]:
    """One HTTP request's trace, set for its task; ended (:meth:`Observed.end`) on leaving, if
    it was not ended before."""
    observed = Observed(scope, metrics, log_json=log_json, finished=finished)
    token = _trace.current.set(observed.trace)
    try:
        yield observed
    finally:
        _trace.current.reset(token)
        observed.end()


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
