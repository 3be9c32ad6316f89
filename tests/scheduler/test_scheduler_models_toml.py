"""models.toml's scheduling keys through the scheduler loop: fake runners, simulated time."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import PinnedModelsInTheWay


async def use(h, model: ModelSpec, keep_alive: float | None = None, options: RunnerOptions | None = None) -> None:  # type: ignore[no-untyped-def]
    async with h.sched.acquire(model, options or RunnerOptions(), keep_alive):
        pass


async def test_the_model_keep_alive_is_the_default_and_a_request_keep_alive_wins(autojump_clock: trio.testing.MockClock) -> None:
    a = spec("a", keep_alive=60.0)
    async with running({"a": 1}, keep_alive=300) as h:
        await use(h, a)
        await trio.sleep(59.9)
        assert len(h.factory.live) == 1
        await trio.sleep(0.2)
        assert h.factory.live == []  # 60 s (the model's), not TRIOSHED_KEEP_ALIVE's 300 s
        await use(h, a, keep_alive=10)
        await trio.sleep(10.1)
        assert h.factory.live == []  # the request's 10 s wins over the model's 60 s


async def test_a_pinned_model_stays_while_others_swap_around_it(autojump_clock: trio.testing.MockClock) -> None:
    # max 2 loaded: without pinning, "p" (idle longest, shortest keep-alive) would be the first victim.
    pinned = spec("p", pinned=True, keep_alive=30.0)
    async with running({"p": 1, "a": 1, "b": 1, "c": 1}, max_loaded=2) as h:
        await use(h, pinned)
        for name in ("a", "b", "c"):
            await trio.sleep(1)
            await use(h, spec(name), keep_alive=600)
        assert ("evict", "p") not in h.record
        assert h.events("evict") == [("evict", "a"), ("evict", "b")]
        assert sorted(r.model.short_name for r in h.factory.live) == ["c", "p"]


async def test_a_request_that_fits_only_by_evicting_a_pinned_model_gets_507(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"p": 16, "small": 4, "big": 12}, gpus=(24,), system=1) as h:
        await use(h, spec("p", pinned=True, keep_alive=math.inf))
        await use(h, spec("small"))
        with pytest.raises(PinnedModelsInTheWay) as excinfo:
            await use(h, spec("big"))
        assert excinfo.value.status == 507 and "pinned models ('p:latest')" in excinfo.value.message
        assert h.events("evict") == []  # neither the pinned one nor, uselessly, "small"
        assert sorted(r.model.short_name for r in h.factory.live) == ["p", "small"]


async def test_the_higher_priority_request_is_loaded_first_when_both_wait_for_memory(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"busy": 20, "low": 16, "high": 16}, gpus=(24,), system=1) as h:
        release = trio.Event()
        await h.hold("busy", release)
        h.nursery.start_soon(use, h, spec("low", priority=0), 0.0)
        await trio.testing.wait_all_tasks_blocked()
        h.nursery.start_soon(use, h, spec("high", priority=5), 0.0)  # arrives later
        await trio.testing.wait_all_tasks_blocked()
        assert h.events("load") == [("load", "busy")]  # both wait for "busy" to finish
        release.set()
        await trio.sleep(30)
        assert h.events("load") == [("load", "busy"), ("load", "high"), ("load", "low")]
        assert h.events("evict")[0] == ("evict", "busy")
