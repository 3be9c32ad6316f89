"""The scheduler under test: in-process fake runners on declared devices, and the ``record`` list of
what happened in order ("load", "start", "ready", "dispatch", "evict", "stop", "unloaded", ...).
Shared by the scheduler's tests and the rooms that drive a scheduler (keys, metrics, the status page)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from trioshed.core.model import Device, ModelSpec, RunnerOptions
from trioshed.devices import DeviceSource
from trioshed.scheduler import Lease, Scheduler
from trioshed.scheduler.runner import Estimator
from trioshed.testing.fake import FakeFactory, fixed_estimator, simple_place

GiB = 1024**3


def spec(name: str, **kw: object) -> ModelSpec:
    return ModelSpec(f"{name}:latest", f"/models/{name}.gguf", **kw)  # type: ignore[arg-type]


def as_spec(model: str | ModelSpec) -> ModelSpec:
    return spec(model) if isinstance(model, str) else model


@dataclass
class Harness:
    sched: Scheduler
    factory: FakeFactory
    record: list[tuple[str, str]]
    nursery: trio.Nursery

    def events(self, *kinds: str) -> list[tuple[str, str]]:
        return [e for e in self.record if not kinds or e[0] in kinds]

    async def hold(self, model: str | ModelSpec, release: trio.Event, *, options: RunnerOptions | None = None,
                   keep_alive: float | None = None) -> Lease:
        """Start a request that holds its lease until ``release`` is set; returns the lease.
        ``model`` is a ModelSpec or the name of one made by ``spec``."""
        got: list[Lease] = []
        ready = trio.Event()

        async def user() -> None:
            async with self.sched.acquire(as_spec(model), options or RunnerOptions(), keep_alive) as lease:
                got.append(lease)
                ready.set()
                await release.wait()

        self.nursery.start_soon(user)
        await ready.wait()
        return got[0]

    def want(self, model: str | ModelSpec, got: list[str], *, options: RunnerOptions | None = None,
             hold: trio.Event | None = None) -> None:
        """Start a request in the background that appends its model's name to ``got`` once it has a
        lease (and holds the lease until ``hold`` is set, if given)."""
        name = model if isinstance(model, str) else model.short_name

        async def user() -> None:
            async with self.sched.acquire(as_spec(model), options or RunnerOptions()):
                got.append(name)
                if hold is not None:
                    await hold.wait()

        self.nursery.start_soon(user)

    async def once(self, name: str, *, options: RunnerOptions | None = None, keep_alive: float | None = None) -> Lease:
        """One request in the calling task: acquire, then release at once."""
        async with self.sched.acquire(spec(name), options or RunnerOptions(), keep_alive) as lease:
            return lease


@asynccontextmanager
async def running(
    sizes: dict[str, float],
    *,
    gpus: tuple[float, ...] = (24,),
    system: float = 4,
    max_queue: int = 16,
    max_loaded: int = 0,
    load_time: float = 1.0,
    keep_alive: float = 300.0,
    max_extra_wait: float = 0.0,
    estimator: Estimator | None = None,
) -> AsyncIterator[Harness]:
    """A scheduler over one declared GPU per ``gpus`` entry and ``system`` GiB of RAM, with models
    of ``sizes`` GiB (or ``estimator``'s sizes, where given)."""
    record: list[tuple[str, str]] = []
    factory = FakeFactory(load_time=load_time, record=record)
    devices = DeviceSource(
        tuple(Device(f"cuda:{i}", "cuda", i, int(g * GiB), int(g * GiB)) for i, g in enumerate(gpus)),
        "declared",
        accounting_only=True,
        fixed_system=Device("cpu", "cpu", 0, int(system * GiB), int(system * GiB)),
    )
    sched = Scheduler(
        devices=devices,
        factory=factory,
        estimator=estimator or fixed_estimator({k: int(v * GiB) for k, v in sizes.items()}),
        place=simple_place,
        max_queue=max_queue,
        max_loaded_models=max_loaded,
        default_keep_alive=keep_alive,
        record=record,
        max_extra_wait=max_extra_wait,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        yield Harness(sched, factory, record, nursery)
        nursery.cancel_scope.cancel()
    assert factory.live == [], "a runner outlived the scheduler"
