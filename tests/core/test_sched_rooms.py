"""Pure tests of the scheduler's decisions outside the planner: admission (tenant limits, the queue
bound, keep-alive), the waiting list and its fast paths, and the context-shrink policy. No trio,
no clock: plain objects standing in for requests and runners."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trioshed.core import admission, queue, shrink
from trioshed.core.context import Shrunk
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.core.views import RunnerState, RunnerView
from trioshed.errors import (
    InsufficientMemory,
    LoadFailed,
    LoadOutOfMemory,
    SmallerContextPreferred,
    TooManyRequests,
)

GiB = 1024**3


def spec(name: str, **kw: object) -> ModelSpec:
    return ModelSpec(f"{name}:latest", f"/m/{name}.gguf", **kw)  # type: ignore[arg-type]


@dataclass
class Key:
    name: str = "alice"
    max_concurrent: int = 0
    max_queued: int = 0


@dataclass
class Req:
    id: int
    model: ModelSpec
    options: RunnerOptions = field(default_factory=RunnerOptions)


@dataclass
class Slot:
    model: ModelSpec
    options: RunnerOptions = field(default_factory=RunnerOptions)
    free_slot: bool = True
    closed_from: float = math.inf

    def view(self) -> RunnerView:
        return RunnerView(1, self.model, self.options, RunnerState.READY)


def test_a_key_at_its_limits_is_refused_and_the_queue_bound_holds() -> None:
    key = Key(max_concurrent=2, max_queued=1)
    assert admission.concurrent_refusal(key, admission.Tenant(queued=1, leased=0)) is None
    refused = admission.concurrent_refusal(key, admission.Tenant(queued=1, leased=1))
    assert isinstance(refused, TooManyRequests) and refused.limit == "concurrent requests"
    assert isinstance(admission.queued_refusal(key, admission.Tenant(queued=1)), TooManyRequests)
    assert admission.queued_refusal(Key(), admission.Tenant(queued=99)) is None  # 0: no limit
    assert admission.queue_full(512, 512) and not admission.queue_full(511, 512)


def test_keep_alive_is_the_requests_else_the_models_else_the_default_and_a_session_pin_holds_it() -> None:
    assert admission.keep_alive(0.0, spec("a", keep_alive=60.0), 300.0) == 0.0
    assert admission.keep_alive(None, spec("a", keep_alive=60.0), 300.0) == 60.0
    assert admission.keep_alive(None, spec("a"), 300.0) == 300.0
    pinned = admission.pinned_for_session(spec("a"), True)
    assert pinned.pinned and pinned.keep_alive == math.inf
    assert admission.pinned_for_session(pinned, False).keep_alive is None
    assert admission.pinned_for_session(spec("a"), None) == spec("a")


def test_the_waiting_list_keeps_arrival_order_and_a_request_queued_again_its_place() -> None:
    waiting: queue.Waiting[Req] = queue.Waiting()
    for i, name in ((2, "a"), (3, "b"), (5, "a")):
        waiting.add(Req(i, spec(name)))
    waiting.add_in_order(Req(1, spec("a")))  # queued again: older than every other
    assert [r.id for r in waiting] == [1, 2, 3, 5]
    assert list(waiting.of_model("/m/a.gguf")) == [1, 2, 5]
    assert waiting.remove(Req(3, spec("b"))) and not waiting.remove(Req(3, spec("b")))
    assert not waiting.of_model("/m/b.gguf") and len(waiting) == 3


def test_the_fast_paths_keep_the_order_the_planner_would() -> None:
    a, big = Slot(spec("a")), RunnerOptions(num_ctx=8192)
    waiting: queue.Waiting[Req] = queue.Waiting()
    assert queue.nothing_ahead(Req(1, spec("a")), waiting, [a])
    waiting.add(Req(1, spec("a"), big))  # waits for a larger runner: holds back nothing a serves
    assert queue.nothing_ahead(Req(2, spec("a")), waiting, [a])
    assert queue.free_runner(Req(2, spec("a")), [a]) is a
    assert queue.free_runner(Req(2, spec("a")), [Slot(spec("a"), closed_from=2)]) is None
    waiting.add(Req(3, spec("a")))
    assert not queue.nothing_ahead(Req(4, spec("a")), waiting, [a])
    assert queue.hand_over(a, waiting, [2]) is None  # the oldest (1) waits for a reload
    waiting.remove(Req(1, spec("a")))
    assert queue.hand_over(a, waiting, [1]) == Req(3, spec("a"))
    assert queue.hand_over(a, waiting, [1, 1]) is None  # two tenants wait: the fair order decides


def test_a_refused_automatic_context_is_tried_at_the_next_bucket_down_to_its_floor() -> None:
    options = RunnerOptions(num_ctx=16384, num_batch=512)
    refusal = InsufficientMemory("a", 8 * GiB, 6 * GiB, num_ctx=16384)
    step = shrink.after_refusal(refusal, options, 4096, None)
    assert step is not None and step.options.num_ctx == 8192
    assert step.shrunk == Shrunk(16384, 16384, "an estimated 8.00 GiB needed, 6.00 GiB available")
    again = shrink.after_refusal(refusal, step.options, 4096, step.shrunk)
    assert again is not None and again.options.num_ctx == 4096 and again.shrunk.asked == 16384
    assert shrink.after_refusal(refusal, again.options, 4096, again.shrunk) is None  # at its floor
    assert shrink.after_refusal(refusal, options, 0, None) is None  # num_ctx set: never lowered
    preferred = SmallerContextPreferred("a", 16384, "would put 3 of 9 layers in system memory")
    step = shrink.after_refusal(preferred, options, 4096, None)
    assert step is not None and step.shrunk.fits_larger
    assert shrink.loads_split(preferred) and not shrink.loads_split(refusal)
    assert shrink.sized(RunnerOptions(num_ctx=8192, num_batch=8192), 4096).num_batch == 4096
    assert shrink.at_floor(options, 4096) == shrink.sized(options, 4096)
    assert shrink.at_floor(options, 0) is None and shrink.at_floor(options, 16384) is None


def test_a_load_out_of_memory_names_llama_cpps_line_without_the_path() -> None:
    model = spec("a")
    error = LoadFailed("llama-server exited with code 1", stderr_tail=f"loading {model.path}: failed to allocate buffer")
    line = shrink.out_of_memory_line(error, model)
    assert line == "loading <a:latest>: failed to allocate buffer"
    assert not shrink.out_of_memory_line(LoadFailed("unknown model architecture"), model)
    loaded = RunnerOptions(num_ctx=8192)
    assert shrink.retries_smaller([(RunnerOptions(num_ctx=8192), 4096)], loaded)
    assert shrink.retries_smaller([(RunnerOptions(num_ctx=4096), 0)], loaded)  # joined a larger load
    assert not shrink.retries_smaller([(RunnerOptions(num_ctx=8192), 0)], loaded)
    assert shrink.stays_queued(RunnerOptions(num_ctx=4096), loaded)
    failure = shrink.out_of_memory_failure(model, RunnerOptions(num_ctx=4096), 4096, line, error)
    assert isinstance(failure, LoadOutOfMemory) and "4,096 tokens" in failure.message
    assert shrink.out_of_memory_failure(model, RunnerOptions(num_ctx=4096), 0, line, error) is error
