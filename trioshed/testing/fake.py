"""In-process fake runners for scheduler tests under ``MockClock`` (no child processes).

A fake "loads" by sleeping ``load_time`` of (simulated) time, can be told to fail loading, and
can be crashed (``crash()``) to exercise the exit watcher. Every start and stop is recorded.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

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
    _exited: trio.Event = field(default_factory=trio.Event)

    async def health(self) -> bool:
        await trio.lowlevel.checkpoint()
        if self.frozen and not self.exited:
            await self._exited.wait()
        return self.healthy and not self.exited and not self.frozen

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    async def wait_exited(self) -> int | None:
        await self._exited.wait()
        return self.returncode

    def kill(self) -> None:
        """What the scheduler does to a hung runner (SIGKILL)."""
        self.crash(-9)

    def crash(self, returncode: int = -9) -> None:
        self.returncode = returncode
        self._exited.set()


class FakeFactory:
    """A runner factory: ``factory(model, options, placement)`` is an async context manager."""

    def __init__(self, *, load_time: float = 1.0, record: list[tuple[str, str]] | None = None) -> None:
        self.load_time = load_time
        self.failing: dict[str, str] = {}  # short model name -> error message
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
