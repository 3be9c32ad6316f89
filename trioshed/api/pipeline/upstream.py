"""Streaming a request to a leased runner, and the body object that owns the lease.

A streamed response is a resource owned by its body (STYLE rule 11): the lease is released when
the body finishes, fails or is closed (client gone), and reclaimed by a finalizer when Quart
never started the body because the client left between the headers and the first chunk.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any, TypeVar

import trio
import trio.lowlevel
from quart import Response

from trioshed.api.pipeline.drain import current_guard
from trioshed.api.protocols.errors import context_error
from trioshed.api.protocols.lora import with_lora
from trioshed.core.adapters import selects
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import RunnerCrashed, RunnerStalled, TrioshedError, UpstreamError
from trioshed.keys import ANONYMOUS, ApiKey
from trioshed.runner.client import ConnectionFailed, Watched, watched
from trioshed.scheduler.contracts import (
    LeaseView,
    PromptFit,
    SchedulerView,
    Upstream,
    UpstreamAnswer,
)
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)
L = TypeVar("L", bound=LeaseView)  # the scheduler's own lease type, as its routes take it


async def crash_or(lease: LeaseView, exc: Exception) -> TrioshedError:
    """The error to report when the upstream connection broke: the runner's crash if it died
    (once the scheduler has recorded it: :meth:`LeaseView.death` waits for that event)."""
    crash = await lease.death()
    if crash is not None:
        return crash
    return UpstreamError(f"connection to llama-server for '{lease.model.name}' failed: {exc}")


async def restore_warm(lease: LeaseView, path: str, body: dict[str, Any] | bytes) -> None:
    """Warm returns: before a request goes to a runner that still has an unused slot, restore
    the saved slot its prompt continues (``trioshed.runner.slots``; a no-op once every slot has
    been used). Bounded like every wait on the runner; a failed restore is logged, not raised."""
    slots = lease.handle.slots
    lora = lease.lora
    if slots is not None and slots.may_restore(path, lora):
        started = trio.current_time()
        restored = await step(lease, lambda: slots.restore_for(path, body, lora))
        if restored is not None and (trace := current_trace.get()) is not None:
            trace.restore_seconds = trio.current_time() - started


async def truncated(lease: LeaseView) -> TrioshedError:
    """The error for an answer that ended before llama-server reported its end."""
    return await crash_or(lease, RuntimeError("llama-server closed the stream early"))


async def step(lease: LeaseView, fn: Callable[[], Any], abort: Callable[[], None] | None = None) -> Any:
    """One wait on the runner, bounded (:meth:`trioshed.api.pipeline.drain.RequestGuard.bounded`): a
    runner that sends nothing for TRIOSHED_STREAM_IDLE_TIMEOUT is hung, so it is replaced once its
    leases end. What it sends is a sign of life for its health monitor (:meth:`LeaseView.produced`).

    A stall is ended by closing the connection the wait is on: ``abort`` (a read of an answer),
    else the connection the pool uses for ``fn``'s requests (:class:`Watched`)."""
    token = None
    if abort is None:
        watch = Watched()
        token, abort = watched.set(watch), watch.abort
    guard = current_guard()  # (the request's; None outside a drained app: unbounded)
    try:
        got = await (fn() if guard is None else guard.bounded(fn, lease.model.name, abort))
    except RunnerStalled:
        lease.evict("stalled: no output within TRIOSHED_STREAM_IDLE_TIMEOUT")
        raise
    finally:
        if token is not None:
            watched.reset(token)
    lease.produced()
    return got


class Last(bytes):
    """A streamed answer's last piece: nothing follows it. The fast path sends it as the answer's
    end (the chunked terminator in the same message), so the client has the whole answer before
    the body's clean-up runs (the runner's connection given back, the lease released: yielded
    inside the upstream's context, that clean-up comes after it). Elsewhere it is plain bytes."""

    __slots__ = ()


#: Under load, the reads of all streamed answers together, a second (see StreamBatching).
READS_PER_SECOND = 1000
#: The reads of each answer relayed as they come before it may be held: a short answer is
#: never held (its end would wait for nothing), a long one from its 17th read on.
EAGER_READS = 16


class StreamBatching:
    """Under load, streamed answers are read from their runners in batches.

    llama-server writes one event per token and stream, so a relay that reads as soon as
    anything arrives pays a wake-up, a read and a send per token and stream: with many streams
    on a CPU that is time taken from the model. From ``from_streams`` streams at once, a stream
    waits after each read until its share of :data:`READS_PER_SECOND` has passed (the number of
    streams over that rate: 8 ms at 8 streams, 16 ms at 16), at most ``window`` (50 ms), and takes
    what arrived meanwhile in one read and one send. The first :data:`EAGER_READS` reads of an
    answer are never held (so neither is a short answer), nor is its end, and fewer streams are
    relayed as they come. ``window`` 0 turns it off (``TRIOSHED_STREAM_BATCH``,
    ``TRIOSHED_STREAM_BATCH_FROM``)."""

    __slots__ = ("from_streams", "streams", "window")

    def __init__(self, window: float = 0.05, from_streams: int = 8) -> None:
        self.window = window
        self.from_streams = from_streams
        self.streams = 0  # streamed answers being relayed now, in this process

    def hold(self) -> float:
        """Seconds a stream waits after a read before the next (0: it reads at once)."""
        if self.window <= 0 or self.streams < self.from_streams:
            return 0.0
        return min(self.window, self.streams / READS_PER_SECOND)


#: The process's one policy (set from the settings when the app is made).
batching = StreamBatching()


async def _bounded_pieces(
    lease: LeaseView, pieces: AsyncIterator[bytes], first: bytes | None, answer: UpstreamAnswer
) -> AsyncGenerator[bytes, None]:
    """``first``, then the rest of ``pieces`` (``answer``'s body), each read bounded
    (:func:`step`) and, under load, held (:class:`StreamBatching`) unless ``answer`` was read to
    its end."""
    if first is None:
        return
    yield first
    batching.streams += 1
    try:
        read_at = trio.current_time()
        reads = 1
        while True:
            if reads >= EAGER_READS and not answer.complete and (hold := batching.hold()):
                await trio.sleep_until(read_at + hold)
            try:
                piece = await step(lease, pieces.__anext__, answer.abort)
            except StopAsyncIteration:
                return
            read_at = trio.current_time()
            reads += 1
            yield piece
    finally:
        batching.streams -= 1


async def run_again_or_raise(lease: LeaseView, error: TrioshedError) -> None:
    """The request failed before any of its answer was handed on: when its runner died, was
    killed as hung, or sent nothing for TRIOSHED_STREAM_IDLE_TIMEOUT, wait for a new runner to
    run it again (:meth:`LeaseView.rerun`: once per request); any other error is raised."""
    if not isinstance(error, RunnerCrashed | RunnerStalled):
        raise error
    log.warning("%s; the request runs again on a new runner", error.message)
    await lease.rerun(error)


@asynccontextmanager
async def open_upstream_bytes(lease: LeaseView, path: str, body: dict[str, Any] | bytes) -> AsyncIterator[AsyncIterator[bytes]]:
    """POST ``body`` (JSON, or bytes already encoded) to the runner; yield its answer's body as
    it arrives, one piece per socket read.

    Raises UpstreamError (with llama-server's own message) for a non-200 answer, and the
    runner's crash error when the connection breaks because the child died (also mid-iteration).
    A runner that dies, or sends nothing for TRIOSHED_STREAM_IDLE_TIMEOUT, before the first piece
    of the body is handed on (the context is entered with it in hand) is replaced: the request
    runs again on a new runner (see :mod:`trioshed.scheduler.lease`).
    """
    while True:
        payload = _payload(lease, path, body)
        await restore_warm(lease, path, body)
        pool = lease.handle.upstream
        handed_on = False
        try:
            async with AsyncExitStack() as stack:
                with lease.waiting_for_answer():
                    response = await step(lease, functools.partial(stack.enter_async_context, pool.request("POST", path, payload)))
                    if response.status != 200:
                        raw = await step(lease, response.read)
                        raise upstream_error(raw, response.status)
                    pieces = await stack.enter_async_context(aclosing(response.batches()))
                    first = await _first_piece(lease, pieces, response)
                handed_on = True
                async with aclosing(_bounded_pieces(lease, pieces, first, response)) as bounded_pieces:
                    yield bounded_pieces
                return
        except ConnectionFailed as exc:
            error = await crash_or(lease, exc)
            if handed_on:
                raise error from None
        except RunnerStalled as exc:
            if handed_on:
                raise
            error = exc
        await run_again_or_raise(lease, error)


async def _first_piece(lease: LeaseView, pieces: AsyncIterator[bytes], answer: UpstreamAnswer) -> bytes | None:
    """The answer's first piece of body (None: the body is empty), bounded like every wait."""
    try:
        piece: bytes = await step(lease, pieces.__anext__, answer.abort)
    except StopAsyncIteration:
        return None
    return piece


@asynccontextmanager
async def open_upstream(lease: LeaseView, path: str, body: dict[str, Any] | bytes) -> AsyncIterator[AsyncIterator[list[bytes]]]:
    """POST ``body`` to the runner; yield its streamed answer as batches of complete lines.

    A batch is what one read from the socket held: under load llama-server's events arrive
    several at a time, and handling them together means one write downstream instead of one
    per token. Errors as in :func:`open_upstream_bytes`.
    """
    async with open_upstream_bytes(lease, path, body) as pieces, aclosing(_line_batches(pieces)) as batches:
        yield batches


async def _line_batches(chunks: AsyncIterator[bytes]) -> AsyncGenerator[list[bytes], None]:
    rest = b""
    async for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        if lines:
            yield lines
    if rest:
        yield [rest]


def _payload(lease: LeaseView, path: str, body: dict[str, Any] | bytes) -> bytes:
    """``body`` as sent to the lease's runner now: with the request's ``lora`` list for that
    runner (an adapter group's: :mod:`trioshed.api.protocols.lora`; again after a rerun, whose
    runner may number its adapters otherwise)."""
    lora = lease.lora
    if lora is not None:
        body = with_lora(path, body, lora, selects=selects(lease.model))
    return body if isinstance(body, bytes) else _encode(body)


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


async def post_upstream_raw(lease: LeaseView, path: str, body: dict[str, Any] | bytes) -> tuple[int, bytes]:
    """POST ``body`` to the runner and return its status and whole answer, whatever the status.

    Nothing is handed on before the whole answer is read: a runner that dies (or is killed as
    hung) on the way is replaced, and the request runs again on a new one (once)."""
    status, _, raw = await request_upstream(lease, "POST", path, body)
    return status, raw


async def request_upstream(
    lease: LeaseView, method: str, path: str, body: dict[str, Any] | bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """Send ``method path`` (with ``body``, JSON or bytes, for a POST) to the runner; return the
    status, headers and whole body of its answer, whatever the status. Runs again on a new
    runner when this one dies first, as :func:`post_upstream_raw`."""
    async def call(pool: Upstream) -> tuple[int, dict[str, str], bytes]:
        async with pool.request(method, path, payload) as response:
            return response.status, dict(response.headers), await response.read()

    while True:
        payload = _payload(lease, path, body) if method == "POST" else (body if isinstance(body, bytes) else _encode(body))
        if method == "POST":
            await restore_warm(lease, path, body)
        try:
            with lease.waiting_for_answer():
                result: tuple[int, dict[str, str], bytes] = await step(lease, functools.partial(call, lease.handle.upstream))
            return result
        except ConnectionFailed as exc:
            error = await crash_or(lease, exc)
        except RunnerStalled as exc:
            error = exc
        await run_again_or_raise(lease, error)


async def post_upstream(lease: LeaseView, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the runner and return its JSON answer (errors as in :func:`open_upstream`)."""
    status, raw = await post_upstream_raw(lease, path, body)
    if status != 200:
        raise upstream_error(raw, status)
    return json_answer(raw)


def json_answer(raw: bytes) -> dict[str, Any]:
    """A runner's whole answer as a JSON object (anything else is an UpstreamError)."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise UpstreamError(f"llama-server answered with invalid JSON: {raw[:200]!r}") from None
    if not isinstance(data, dict):
        raise UpstreamError("llama-server answered with something other than a JSON object")
    return data


def upstream_error(raw: bytes, status: int) -> TrioshedError:
    """The error for llama-server's non-200 answer ``raw``: a prompt too long for the context in
    each protocol's words (ContextTooLong), else UpstreamError with llama-server's message."""
    too_long = context_error(raw) if status == 400 else None
    if too_long is not None:
        return too_long
    return UpstreamError(upstream_message(raw, status), status=client_status(status, raw))


def client_status(status: int, raw: bytes) -> int:
    """llama-server's status, except two 500s that the request's text causes, so 400: an input
    larger than the runner's batch (``num_batch``, embeddings), and "_Map_base::at", what its
    tokenizer throws for characters the model's vocabulary cannot encode (no byte fallback; found
    by fuzzing with the tiny test models)."""
    if status == 500 and (b"too large to process" in raw or b"_Map_base::at" in raw):
        return 400
    return status


def upstream_message(raw: bytes, status: int) -> str:
    try:
        data = json.loads(raw)
        error = data.get("error", data)
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = raw.decode("utf-8", "replace")[:500]
    return f"llama-server answered {status}: {message}"


class LeasedBody:
    """An async iterator over a response body that releases its lease exactly once. ``first``:
    the body's first piece, read already (:func:`leased_stream`), handed on before the rest."""

    def __init__(self, lease: LeaseView, body: AsyncIterator[bytes], first: bytes | None = None) -> None:
        self._lease = lease
        self._body = body
        self._first = first
        self._token = trio.lowlevel.current_trio_token()
        self._ended = False  # read to its end: nothing left to close

    def __aiter__(self) -> LeasedBody:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return await self._body.__anext__()
        except BaseException as exc:
            self._ended = isinstance(exc, StopAsyncIteration)
            self._lease.release()
            raise

    async def aclose(self) -> None:
        if self._ended:  # read to its end: the lease went back then
            return
        try:
            aclose: Callable[[], Any] | None = getattr(self._body, "aclose", None)
            if aclose is not None:
                with trio.move_on_after(1, shield=True):
                    await aclose()
        finally:
            self._lease.release()

    def __del__(self) -> None:
        # Never entered (the client left before Quart entered the body): give the lease back on
        # the Trio thread, outside whatever code the garbage collector interrupted, and close the
        # body, started already to read its first piece, in a task of its own.
        if not self._lease.released:
            try:
                self._token.run_sync_soon(self._abandoned)
            except trio.RunFinishedError:
                pass

    def _abandoned(self) -> None:
        self._lease.release()
        aclose: Callable[[], Any] | None = getattr(self._body, "aclose", None)
        if aclose is not None:
            trio.lowlevel.spawn_system_task(_close_shielded, aclose, name="abandoned stream body")


async def _close_shielded(aclose: Callable[[], Any]) -> None:
    with trio.move_on_after(1, shield=True):
        await aclose()


async def leased_stream(
    scheduler: SchedulerView[L],
    model: ModelSpec,
    options: RunnerOptions,
    keep_alive: float | None,
    body: Callable[[L], AsyncIterator[bytes]],
    content_type: str,
    *,
    key: ApiKey = ANONYMOUS,
    fit: PromptFit | None = None,
) -> Response:
    """Wait for a lease, then for the first piece of the streamed ``body(lease)``, then answer
    with the body, which owns the lease.

    The status is decided before this returns: queue full, cannot fit, load failed, a prompt
    too long for the context, and whatever the runner refuses before the first byte of its
    answer (a ``body`` raises an error it meets before it yielded anything) raise here, to be
    answered with their status in the protocol's shape, not a 200 that ends in an error event.
    So the head of a stream waits for the runner's first byte, as llama-server's own does.
    The lease goes back when the body ends, fails or is closed, or is never entered.
    ``key``, ``fit``: whose request, and how its prompt is fitted (``Scheduler.acquire``).
    """
    lease = await scheduler.wait_for_lease(model, options, keep_alive, key=key, fit=fit)
    try:
        chunks = body(lease)
        try:
            first: bytes | None = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        response = Response(LeasedBody(lease, chunks, first), content_type=content_type)
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long token streams
    except BaseException:
        lease.release()
        raise
    return response
