"""In-process fake runners for scheduler tests under ``MockClock`` (no child processes).

A fake "loads" by sleeping ``load_time`` of (simulated) time, can be told to fail loading, and
can be crashed (``crash()``) to exercise the exit watcher, frozen (``frozen``), made slow to
answer its health check (``health_time``), or seen to exit late (``exit_seen_after``). Every start and stop is recorded.
Its ``upstream`` answers requests in-process as a runner's connection pool would (see
:class:`FakeUpstream`), so the edge's upstream code runs against it under ``MockClock`` too.
The fakes implement the scheduler's Protocols in full (:class:`~trioshed.scheduler.contracts.RunnerHandle`,
:class:`~trioshed.scheduler.contracts.Upstream`), as mypy checks at the end of this module.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
import trio.lowlevel

from trioshed.core.model import (
    Device,
    DoesNotFit,
    MemoryEstimate,
    ModelSpec,
    Placement,
    RunnerOptions,
)
from trioshed.errors import LoadFailed
from trioshed.runner.client import ConnectionFailed, watched
from trioshed.runner.output import OutputTail
from trioshed.runner.slots import RunnerSlots
from trioshed.scheduler.contracts import RunnerHandle, Upstream, UpstreamAnswer

_pids = itertools.count(10_000)


@dataclass(eq=False)
class FakeRunner:
    model: ModelSpec
    options: RunnerOptions
    placement: Placement
    pid: int = field(default_factory=lambda: next(_pids))
    returncode: int | None = None
    measured: None = None
    base_url: str = "http://fake.invalid"
    healthy: bool = True
    frozen: bool = False  # a stopped process: its health check never answers
    #: Seconds (simulated) its health check takes to answer (a saturated CPU; inf: never), while
    #: it answers requests as usual.
    health_time: float = 0.0
    #: Seconds (simulated) between its exit and ``wait_exited`` returning: a starved event loop,
    #: on which the runner's lifetime task sees the exit late (``exited`` is true at once).
    exit_seen_after: float = 0.0
    _exited: trio.Event = field(default_factory=trio.Event)
    #: What it answers each request: these pieces of body, ``piece_time`` apart (simulated).
    answer: tuple[bytes, ...] = (b'{"content":"ok"}',)
    piece_time: float = 0.5
    head_time: float = 0.5  # from the request to its answer's head
    requests: list[str] = field(default_factory=list)  # the paths it was sent, in order
    sent: trio.Event = field(default_factory=trio.Event)  # set by its first request
    upstream: FakeUpstream = field(init=False)
    speculation: tuple[int, int] = (0, 0)  # (tokens drafted, accepted): a fake drafts nothing
    slots: RunnerSlots | None = None  # no warm returns
    tail: OutputTail = field(default_factory=OutputTail)  # a fake prints nothing

    def __post_init__(self) -> None:
        self.upstream = FakeUpstream(self)

    async def health(self) -> bool:
        await trio.lowlevel.checkpoint()
        if self.health_time:
            await trio.sleep(self.health_time)
        if self.frozen and not self.exited:
            await self._exited.wait()
        return self.healthy and not self.exited and not self.frozen

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    async def wait_exited(self) -> int | None:
        await self._exited.wait()
        if self.exit_seen_after:
            await trio.sleep(self.exit_seen_after)
        return self.returncode

    def kill(self) -> None:
        """What the scheduler does to a hung runner (SIGKILL)."""
        self.crash(-9)

    def crash(self, returncode: int = -9) -> None:
        self.returncode = returncode
        self._exited.set()

    async def _wait(self, seconds: float, *, received: int) -> None:
        """``seconds`` of answering (forever while frozen); the connection breaks if it dies."""
        with trio.move_on_after(math.inf if self.frozen else seconds):
            await self._exited.wait()
        if self.frozen and not self.exited:
            await self._exited.wait()  # frozen meanwhile
        if self.exited:
            raise ConnectionFailed("reading llama-server's answer failed: ECONNRESET (fake)", received=received)


class FakeUpstream:
    """A fake runner's connection pool: ``request()`` and ``post()`` as :class:`UpstreamPool`'s.

    A dead runner refuses the connection; a frozen one takes the request and answers nothing
    until it dies (then the connection breaks); a runner that dies mid-answer breaks it there.
    """

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes = b"", *, content_type: str = "application/json") -> AsyncIterator[FakeResponse]:
        runner = self.runner
        await trio.lowlevel.checkpoint()
        if runner.exited:
            raise ConnectionFailed("cannot connect to llama-server: ECONNREFUSED (fake)")
        runner.requests.append(path)
        runner.sent.set()
        connection = _FakeConnection()
        watch = watched.get()
        if watch is not None:
            watch.connection = connection  # as the real pool notes its connection
        try:
            with connection.waiting:
                await runner._wait(runner.head_time, received=0)
            if connection.closed:
                raise ConnectionFailed("connection to llama-server failed: closed (fake)")
        finally:
            if watch is not None and watch.connection is connection:
                watch.connection = None
        yield FakeResponse(runner)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.request("POST", path, body) as response:
            return response.status, await response.read()

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.request("GET", path) as response:
            return response.status, await response.read()


class _FakeConnection:
    """What a stalled request's head wait is ended by: closing it (``Watched.abort``)."""

    def __init__(self) -> None:
        self.waiting = trio.CancelScope()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.waiting.cancel(reason="connection closed")


class FakeResponse:
    status = 200

    def __init__(self, runner: FakeRunner) -> None:
        self._runner = runner
        self.headers = {"content-type": "application/json"}
        self.complete = False
        self._aborted = False
        self._reading: trio.CancelScope | None = None  # the wait for the next piece, under way

    def abort(self) -> None:
        """As a closed connection: the read under way, and every later one, fails."""
        self._aborted = True
        if self._reading is not None:
            self._reading.cancel(reason="connection closed")

    async def batches(self) -> AsyncGenerator[bytes, None]:
        received = 0
        answer = self._runner.answer
        for i, piece in enumerate(answer):
            if i:
                with trio.CancelScope() as self._reading:
                    if not self._aborted:
                        await self._runner._wait(self._runner.piece_time, received=received)
                self._reading = None
            if self._aborted:
                raise ConnectionFailed("reading llama-server's answer failed: connection closed (fake)", received=received)
            received += len(piece)
            self.complete = i == len(answer) - 1
            yield piece
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.batches()])


class FakeFactory:
    """A runner factory: ``factory(model, options, placement)`` is an async context manager."""

    def __init__(self, *, load_time: float = 1.0, record: list[tuple[str, str]] | None = None) -> None:
        self.load_time = load_time
        self.failing: dict[str, str] = {}  # short model name -> error message
        self.killed_loading: dict[str, int] = {}  # short model name -> loads to die of SIGKILL
        self.record = record if record is not None else []
        self.live: list[FakeRunner] = []
        self.started = 0

    @asynccontextmanager
    async def __call__(self, model: ModelSpec, options: RunnerOptions, placement: Placement) -> AsyncIterator[FakeRunner]:
        self.started += 1
        self.record.append(("start", model.short_name))
        await trio.sleep(self.load_time)
        if model.short_name in self.failing:
            self.record.append(("load error", model.short_name))
            raise LoadFailed(self.failing[model.short_name], returncode=1)
        if self.killed_loading.get(model.short_name, 0) > 0:
            self.killed_loading[model.short_name] -= 1
            self.record.append(("killed loading", model.short_name))
            raise LoadFailed("llama-server exited with code -9 before it was ready", returncode=-9)
        runner = FakeRunner(model, options, placement)
        self.live.append(runner)
        try:
            yield runner
        finally:
            self.live.remove(runner)
            self.record.append(("stop", model.short_name))

    def runner(self, short_name: str) -> FakeRunner:
        return next(r for r in self.live if r.model.short_name == short_name)


def fixed_estimator(sizes: dict[str, int], layers: int = 4):  # type: ignore[no-untyped-def]
    """An estimator giving each model (by short name) a total of ``sizes[name]`` bytes."""

    def estimate(model: ModelSpec, options: RunnerOptions) -> MemoryEstimate:
        total = sizes[model.short_name]
        per_layer = total // (layers + 1)
        return MemoryEstimate(
            weights=per_layer * layers,
            kv=0,
            output=total - per_layer * layers,
            token_embd=0,
            compute_full=0,
            compute_partial=0,
            layers=(per_layer,) * layers,
        )

    return estimate


def simple_place(
    est: MemoryEstimate,
    gpus: tuple[Device, ...],
    *,
    system_free: int,
    num_gpu: int = -1,
    spread: bool = False,
    overhead: int = 0,
) -> Placement | DoesNotFit:
    """A deliberately simple placer for scheduler tests: whole model on the emptiest GPU that
    holds it, else in system memory, else DoesNotFit. (Real placement: ``core.placement``.)"""
    if num_gpu != 0:
        fitting = [g for g in gpus if g.free - overhead >= est.total]
        if fitting:
            best = max(fitting, key=lambda g: (g.free, -g.index))
            return Placement(len(est.layers) + 1, devices=(best.id,), vram=((best.id, est.total),))
    if est.total <= system_free:
        return Placement(0, ram=est.total)
    largest = max([g.total - overhead for g in gpus] + [system_free])
    return DoesNotFit(needed=est.total, available=largest, reason="test placer")


if TYPE_CHECKING:

    def _implements(runner: FakeRunner) -> tuple[RunnerHandle, Upstream, UpstreamAnswer]:
        """Never called: mypy checks here that the fakes implement the Protocols in full."""
        return runner, runner.upstream, FakeResponse(runner)
