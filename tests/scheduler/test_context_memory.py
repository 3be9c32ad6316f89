"""An automatic context that does not fit the memory is loaded at the largest bucket that does.

Simulated time, in-process fake runners whose size grows with their context (1 GiB of weights,
3 for "b", plus 1 GiB per 4,096 cells) on one declared 6 GiB GPU and no system memory. The
planner's 507 and llama.cpp's own out-of-memory failure (``failed to allocate``) both place the
request at the next smaller bucket, down to its ``floor``; a ``num_ctx`` the user set
(``floor=0``) is never lowered. The lease says what was made smaller (``Lease.shrunk``), which
the HTTP edge uses to answer a 507 rather than a 400 (tests/e2e/test_context_memory_e2e.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.scheduler.harness import spec
from trioshed.core.context import Shrunk, out_of_memory, smaller_context
from trioshed.core.model import Device, MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.devices import DeviceSource
from trioshed.errors import InsufficientMemory, LoadCooldown, LoadFailed, LoadOutOfMemory
from trioshed.scheduler import Scheduler
from trioshed.testing.fake import FakeFactory, FakeRunner, simple_place

GiB = 1024**3
#: What llama.cpp b10068 prints when the KV cache does not fit (the Vulkan backend).
OOM = (
    "llama-server exited with code 1 before it was ready; last output: "
    "'llama_kv_cache: failed to allocate Vulkan0 buffer of size 3221225472'"
)


def estimate(model: ModelSpec, options: RunnerOptions) -> MemoryEstimate:
    """1 GiB of weights (3 for "b") plus 1 GiB of KV cache per 4,096 cells."""
    weights = (3 if model.short_name == "b" else 1) * GiB
    kv = options.num_ctx * GiB // 4096
    return MemoryEstimate(
        weights=weights, kv=kv, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=(weights + kv,)
    )


class OomFactory(FakeFactory):
    """Fake runners that fail as llama.cpp does when their context is above ``limit`` cells."""

    def __init__(self, limit: int, message: str = OOM) -> None:
        super().__init__()
        self.limit, self.message, self.sizes = limit, message, list[int]()

    @asynccontextmanager
    async def __call__(self, model: ModelSpec, options: RunnerOptions, placement: Placement) -> AsyncIterator[FakeRunner]:
        self.sizes.append(options.num_ctx)
        if options.num_ctx > self.limit:
            self.failing[model.short_name] = self.message
        else:
            self.failing.pop(model.short_name, None)
        async with super().__call__(model, options, placement) as runner:
            yield runner


@asynccontextmanager
async def scheduler(factory: FakeFactory, gpu: float = 6, system: float = 0) -> AsyncIterator[Scheduler]:
    """A declared GPU of ``gpu`` GiB and ``system`` GiB of system memory (none: nothing spills)."""
    devices = DeviceSource(
        (Device("cuda:0", "cuda", 0, int(gpu * GiB), int(gpu * GiB)),), "declared", accounting_only=True,
        fixed_system=Device("cpu", "cpu", 0, int(system * GiB), int(system * GiB)),
    )  # fmt: skip
    sched = Scheduler(devices=devices, factory=factory, estimator=estimate, place=simple_place, record=factory.record)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        yield sched
        nursery.cancel_scope.cancel()
    assert factory.live == [], "a runner outlived the scheduler"


def test_the_next_size_is_the_bucket_below_and_never_under_the_floor() -> None:
    assert smaller_context(32768, 4096) == 16384
    assert smaller_context(16384, 4096) == 8192
    assert smaller_context(12000, 4096) == 8192  # a size clamped by TRIOSHED_CONTEXT_MAX: the bucket below
    assert smaller_context(10000, 8192) == 8192
    assert smaller_context(8192, 8192) is None  # at the floor: nothing smaller holds the request
    assert smaller_context(4096, 8192) is None
    assert smaller_context(16384, 0) is None  # num_ctx set by the user: never lowered
    assert smaller_context(3000, 1000) == 2048  # under FLOOR (a trained context that small)


def test_llama_cpps_out_of_memory_words_are_recognised_and_others_are_not() -> None:
    assert out_of_memory(f"load_tensors: loading model\n{OOM}\nmain: exiting") == OOM  # the line that says it
    assert out_of_memory("ggml_vulkan: Device memory allocation of size 1 failed. vk::OutOfDeviceMemoryError")
    assert out_of_memory("llama_init_from_model: failed to allocate compute buffers")
    assert out_of_memory("CUDA error: out of memory")
    assert not out_of_memory("llama_model_load: error loading model: unknown model architecture: 'foo'")
    assert not out_of_memory("")


async def test_a_bound_that_does_not_fit_loads_the_largest_bucket_that_does(autojump_clock: trio.testing.MockClock) -> None:
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:  # 32,768 cells: 9 GiB on a 6 GiB GPU; 16,384: 5 GiB
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as lease:
            assert lease.options.num_ctx == 16384
            assert lease.shrunk is not None
            assert (lease.shrunk.asked, lease.shrunk.tried, lease.shrunk.fits_larger) == (32768, 32768, False)
            assert "9.00 GiB needed, 6.00 GiB available" in lease.shrunk.why
        assert factory.sizes == [16384]  # never loaded at a size the planner knew would not fit
        assert factory.record.count(("smaller context", "a")) == 1
        # the next request asking for the same size is served by that runner: no reload, no eviction
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as again:
            assert again.options.num_ctx == 16384 and again.shrunk is not None
        assert factory.sizes == [16384] and ("evict", "a") not in factory.record


async def test_a_request_that_fits_gets_its_own_size_and_says_nothing_was_shrunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=8192), floor=4096) as lease:
            assert lease.options.num_ctx == 8192 and lease.shrunk is None
        assert ("smaller context", "a") not in factory.record


async def test_a_size_set_by_the_user_that_does_not_fit_is_a_507_never_a_smaller_context(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:
        with pytest.raises(InsufficientMemory, match="at a context of 32,768 tokens") as info:
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768)):
                pass
        assert info.value.status == 507
        assert factory.sizes == [] and ("smaller context", "a") not in factory.record


async def test_nothing_at_or_above_the_floor_fits_is_a_507_naming_the_floor(autojump_clock: trio.testing.MockClock) -> None:
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:
        with pytest.raises(InsufficientMemory, match="at a context of 32,768 tokens"):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=65536), floor=32768):
                pass
        assert factory.sizes == []
        assert factory.record.count(("smaller context", "a")) == 1  # 65,536, then 32,768: no lower


async def test_a_loaded_runner_of_the_model_is_not_evicted_for_a_size_that_cannot_fit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """"a" runs at 4,096; a request for 65,536 (17 GiB) fails before it evicts that runner."""
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=4096)):
            pass
        with pytest.raises(InsufficientMemory):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=65536)):
                pass
        assert ("evict", "a") not in factory.record and sched.statistics().loaded == 1


async def test_a_load_that_runs_out_of_memory_is_tried_at_the_next_smaller_bucket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=8192)  # the estimate says 16,384 fits; the device says otherwise
    async with scheduler(factory) as sched:
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384), floor=4096) as lease:
            assert lease.options.num_ctx == 8192
            assert lease.shrunk == Shrunk(16384, 16384, "llama.cpp ran out of memory loading it")
        assert factory.sizes == [16384, 8192]
        stats = sched.statistics()
        assert stats.load_failures == 1 and stats.loads == 2
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=4096), floor=4096):  # no cooldown left behind
            pass


async def test_an_out_of_memory_load_at_a_size_set_by_the_user_fails_and_cools_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=8192)
    async with scheduler(factory) as sched:
        with pytest.raises(LoadFailed, match="failed to allocate"):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384)):
                pass
        with pytest.raises(LoadCooldown):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384)):
                pass
        assert factory.sizes == [16384]


async def test_only_an_out_of_memory_failure_is_tried_again_smaller(autojump_clock: trio.testing.MockClock) -> None:
    factory = OomFactory(limit=8192, message="llama_model_load: error loading model: unknown model architecture")
    async with scheduler(factory) as sched:
        with pytest.raises(LoadFailed, match="unknown model architecture"):
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384), floor=4096):
                pass
        assert factory.sizes == [16384]


async def test_out_of_memory_down_to_the_floor_is_a_507_with_llama_cpps_words_and_no_cooldown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=2048)  # not even the floor fits
    async with scheduler(factory) as sched:
        with pytest.raises(LoadOutOfMemory) as info:
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384), floor=4096):
                pass
        assert info.value.status == 507 and isinstance(info.value, InsufficientMemory)
        assert "a context of 4,096 tokens" in info.value.message and "failed to allocate Vulkan0" in info.value.message
        assert factory.sizes == [16384, 8192, 4096]
        assert sched.statistics().load_failures == 3
        factory.limit = 4096  # memory freed elsewhere: the next request loads at once (no cooldown)
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=4096), floor=4096) as lease:
            assert lease.options.num_ctx == 4096 and lease.shrunk is None
        assert factory.sizes == [16384, 8192, 4096, 4096]


async def test_of_two_requests_on_one_failed_load_only_the_automatic_one_is_tried_smaller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=8192)
    results: dict[str, object] = {}
    async with scheduler(factory) as sched:

        async def ask(name: str, floor: int) -> None:
            try:
                async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384), floor=floor) as lease:
                    results[name] = lease.options.num_ctx
            except LoadFailed as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "set", 0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "automatic", 4096)
        assert results["automatic"] == 8192
        assert isinstance(results["set"], LoadFailed)
        assert factory.sizes == [16384, 8192]


async def test_a_smaller_request_that_joined_an_out_of_memory_load_is_loaded_at_its_own_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=4096)
    sizes: dict[str, int] = {}
    async with scheduler(factory) as sched:

        async def ask(name: str, num_ctx: int, floor: int) -> None:
            async with sched.acquire(spec("a"), RunnerOptions(num_ctx=num_ctx), floor=floor) as lease:
                sizes[name] = lease.options.num_ctx

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "long", 16384, 4096)
            await trio.testing.wait_all_tasks_blocked()
            assert factory.sizes == [16384]
            nursery.start_soon(ask, "set", 4096, 0)  # joins the larger load: never tried at its own size
        assert sizes == {"long": 4096, "set": 4096}
        assert factory.sizes == [16384, 8192, 4096]
        assert sched.statistics().load_failures == 2


async def test_a_smaller_size_that_fits_beside_the_loaded_models_is_tried_before_evicting_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """"b" (3 GiB + 1 GiB at 4,096) is loaded on the 6 GiB GPU. "a" asks 32,768 (9 GiB): it
    cannot fit even alone; 16,384 (5 GiB) fits only by evicting "b", and 8,192 (3 GiB) too, but
    4,096 (2 GiB) fits beside it: loaded there, "b" kept. Counted and found to need more, the
    request grows to the bucket of its count, which evicts "b" as any 5 GiB model would."""
    factory = OomFactory(limit=10**9)
    async with scheduler(factory) as sched:
        async with sched.acquire(spec("b"), RunnerOptions(num_ctx=4096)):
            pass
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as lease:
            assert lease.options.num_ctx == 4096
            assert lease.shrunk is not None and lease.shrunk.fits_larger
            assert (lease.shrunk.asked, lease.shrunk.tried) == (32768, 8192)
            assert lease.shrunk.why == "would not fit beside the models loaded now"
            assert ("evict", "b") not in factory.record and sched.statistics().loaded == 2
            await lease.regrow(16384)
            assert lease.options.num_ctx == 16384
        assert factory.sizes == [4096, 4096, 16384]
        assert ("evict", "b") in factory.record


async def test_with_nothing_in_the_way_the_largest_size_that_fits_is_loaded_evicting_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """"b" at 4,096 (4 GiB) on a 12 GiB GPU: "a" at 16,384 (5 GiB) fits beside it as asked."""
    factory = OomFactory(limit=10**9)
    async with scheduler(factory, gpu=12) as sched:
        async with sched.acquire(spec("b"), RunnerOptions(num_ctx=4096)):
            pass
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=16384), floor=4096) as lease:
            assert lease.options.num_ctx == 16384 and lease.shrunk is None
        assert ("evict", "b") not in factory.record and ("smaller context", "a") not in factory.record


@asynccontextmanager
async def with_system_memory(factory: FakeFactory, gpu: float) -> AsyncIterator[Scheduler]:
    """Like :func:`scheduler`, with 64 GiB of system memory: what does not fit the GPU spills there."""
    async with scheduler(factory, gpu, system=64) as sched:
        yield sched


async def test_a_size_that_would_spill_to_system_memory_is_made_smaller_and_grows_back_on_the_exact_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """32,768 cells (9 GiB) would run in system memory; 16,384 (5 GiB) stays on the 6 GiB GPU."""
    factory = OomFactory(limit=10**9)
    async with with_system_memory(factory, gpu=6) as sched:
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as lease:
            assert lease.options.num_ctx == 16384
            assert lease.shrunk is not None and lease.shrunk.fits_larger
            assert lease.shrunk.why == "would put 2 of 2 layers in system memory"
            assert factory.sizes == [16384]
            # counted, it needs more than 16,384: it grows to the bucket of its count, spilling
            await lease.regrow(32768)
            assert lease.options.num_ctx == 32768 and lease.shrunk is None
            assert factory.runner("a").placement.n_gpu_layers == 0  # in system memory, as it must
        assert factory.sizes == [16384, 32768]
        assert sched.statistics().leased == 0


async def test_no_smaller_size_is_tried_when_the_smallest_would_spill_too_or_the_size_was_set(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = OomFactory(limit=10**9)
    async with with_system_memory(factory, gpu=1.5) as sched:  # not even 4,096 (2 GiB) fits the GPU
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as lease:
            assert lease.options.num_ctx == 32768 and lease.shrunk is None
    factory = OomFactory(limit=10**9)
    async with with_system_memory(factory, gpu=6) as sched:
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768)) as lease:  # num_ctx set: as set
            assert lease.options.num_ctx == 32768 and lease.shrunk is None
        assert factory.sizes == [32768] and ("smaller context", "a") not in factory.record


async def test_a_spill_with_no_smaller_estimate_after_all_loads_split_rather_than_fail(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The smaller size's estimate cannot be read (the header changed under it): the request is
    loaded at its own size, split with system memory, never refused for a split it could run."""

    def flaky(model: ModelSpec, options: RunnerOptions) -> MemoryEstimate:
        if options.num_ctx == 16384:
            raise ValueError("header changed")
        return estimate(model, options)

    factory = OomFactory(limit=10**9)
    devices = DeviceSource(
        (Device("cuda:0", "cuda", 0, 6 * GiB, 6 * GiB),), "declared", accounting_only=True,
        fixed_system=Device("cpu", "cpu", 0, 64 * GiB, 64 * GiB),
    )  # fmt: skip
    sched = Scheduler(devices=devices, factory=factory, estimator=flaky, place=simple_place, record=factory.record)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with sched.acquire(spec("a"), RunnerOptions(num_ctx=32768), floor=4096) as lease:
            assert lease.options.num_ctx == 32768 and lease.shrunk is None
        assert factory.sizes == [32768]
        nursery.cancel_scope.cancel()
    assert factory.live == []
