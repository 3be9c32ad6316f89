"""Adapter groups, decided without I/O: which runner serves a model, the ``lora`` list a request
sends, the turns adapter sets take, where adapter memory goes, and the store's group index."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trioshed.core.adapter_memory import adapter_bytes, with_adapters
from trioshed.core.adapter_turns import Turns, in_turns
from trioshed.core.adapters import adapter_set, group_of, lora_field, runner_model, selects, serves
from trioshed.core.kvcache import CacheKey, FileIdentity
from trioshed.core.model import MemoryEstimate, ModelSpec, RunnerOptions
from trioshed.core.sched import Dispatch, Evict, Load, Machine, RequestView, plan
from trioshed.core.views import RunnerState, RunnerView, can_serve
from trioshed.runner.command import lora_args
from trioshed.testing.fake import simple_place

GROUP = ("/m/l1.gguf", "/m/l2.gguf", "/m/l3.gguf")


def spec(name: str, *adapters: str, scales: tuple[float, ...] = (), group: tuple[str, ...] = GROUP) -> ModelSpec:
    return ModelSpec(f"{name}:latest", "/m/base.gguf", adapters=adapters, adapter_scales=scales, group=group)


def view(model: ModelSpec, options: RunnerOptions | None = None) -> RunnerView:
    return RunnerView(1, model, options or RunnerOptions(), RunnerState.READY)


def test_a_group_runner_loads_every_adapter_and_each_request_selects_its_own() -> None:
    base, a2 = spec("base"), spec("a2", "/m/l2.gguf")
    runner = runner_model(a2)
    assert runner.adapters == GROUP and selects(runner) and runner_model(runner) == runner  # idempotent
    assert runner_model(base).adapters == GROUP  # the base's runner is the group's too
    assert lora_field(runner, a2) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    assert lora_field(runner, base) == [{"id": i, "scale": 0.0} for i in range(3)]  # every adapter off: the base
    for member in (base, a2, spec("a3", "/m/l3.gguf")):
        assert can_serve(view(runner), member, RunnerOptions())


def test_two_adapters_on_one_model_apply_both_at_their_scales() -> None:
    both = spec("both", "/m/l3.gguf", "/m/l1.gguf", scales=(0.5, 2.0))
    runner = runner_model(both)
    assert lora_field(runner, both) == [{"id": 0, "scale": 2.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.5}]
    assert adapter_set(both) == (("/m/l1.gguf", 2.0), ("/m/l3.gguf", 0.5))
    alone = replace(both, group=())
    assert lora_args(runner_model(alone)) == ["--lora", "/m/l3.gguf,/m/l1.gguf"]  # one flag, never repeated
    assert lora_args(runner_model(alone, embedding=True)) == ["--lora-scaled", "/m/l3.gguf:0.5,/m/l1.gguf:2"]


def test_a_model_created_after_its_runner_loaded_is_not_served_by_it() -> None:
    runner = runner_model(spec("a1", "/m/l1.gguf"))
    newer = spec("a4", "/m/l4.gguf", group=(*GROUP, "/m/l4.gguf"))
    assert not serves(runner, newer) and not can_serve(view(runner), newer, RunnerOptions())
    with pytest.raises(ValueError):
        lora_field(runner, newer)
    # a model the store did not know yet still brings its own adapters into its runner
    assert group_of(spec("a5", "/m/l5.gguf")) == (*GROUP, "/m/l5.gguf")


def test_an_embedding_request_needs_a_runner_with_exactly_its_adapters_fixed() -> None:
    a1 = spec("a1", "/m/l1.gguf")
    fixed = runner_model(a1, embedding=True)
    assert fixed.adapters == ("/m/l1.gguf",) and not selects(fixed)
    embedding = RunnerOptions(embedding=True, cache_ram_mib=0)
    assert can_serve(view(fixed, embedding), a1, embedding)
    assert not can_serve(view(runner_model(a1), embedding), a1, embedding)  # a group runner cannot select there
    assert not can_serve(view(fixed, embedding), spec("a2", "/m/l2.gguf"), embedding)


def test_a_comma_in_an_adapter_path_is_refused() -> None:
    with pytest.raises(ValueError, match="comma"):
        lora_args(replace(spec("x", "/m/a,b.gguf"), group=()))


def test_turns_round_robin_with_a_bound() -> None:
    flood = [("a", i) for i in range(10)]
    queued = [*flood, ("b", 0), ("c", 0)]
    order = in_turns(queued, lambda q: ((q[0], 1.0),), Turns().after((("a", 1.0),), 1), 1)
    assert [name for name, _ in order][:4] == ["b", "c", "a", "a"]  # b and c pass a's ten
    order = in_turns(queued, lambda q: ((q[0], 1.0),), Turns().after((("a", 1.0),), 2), 2)
    assert [name for name, _ in order][:5] == ["a", "b", "c", "a", "a"]  # a's turn had one slot left
    for size in (1, 2, 4):  # at most size * (sets) others pass the oldest of a set
        order = in_turns(queued, lambda q: ((q[0], 1.0),), Turns(), size)
        assert order.index(("c", 0)) <= size * 2


def test_adapter_bytes_go_with_the_layers_they_adapt() -> None:
    est = MemoryEstimate(weights=40, kv=8, output=10, token_embd=5, compute_full=3, compute_partial=2, layers=(12, 12, 12, 12))
    a = adapter_bytes([("blk.0.attn_q.weight.lora_a", 4), ("blk.0.attn_q.weight.lora_b", 6), ("blk.3.ffn_up.weight.lora_a", 2),
                       ("token_embd.weight.lora_a", 1), ("output.weight.lora_b", 7), ("blk.9.attn_q.weight.lora_a", 3)], 4)  # fmt: skip
    assert a.layers == (10, 0, 0, 2) and (a.token_embd, a.output) == (1, 10) and a.total == 23
    folded = with_adapters(est, [a, a])
    assert folded.layers == (32, 12, 12, 16) and folded.weights == 64 and folded.output == 30 and folded.token_embd == 7
    assert folded.total == est.total + 2 * a.total and sum(folded.layers) == folded.weights + folded.kv
    with pytest.raises(ValueError):
        with_adapters(est, [adapter_bytes([], 3)])


def test_a_slot_key_names_the_adapters_applied_and_their_scales() -> None:
    base = CacheKey(FileIdentity("/m/base.gguf", 1, 2, "ab"))
    l1 = FileIdentity("/m/l1.gguf", 3, 4, "cd")
    plain = replace(base, adapters=(l1,))
    assert replace(plain, scales=(1.0,)).id == plain.id  # scale 1: the key as before scales
    assert len({base.id, plain.id, replace(plain, scales=(0.5,)).id}) == 3


def test_a_hot_adapter_set_gets_a_runner_of_its_own_only_when_it_pays() -> None:
    from trioshed.core.own_runner import SUSTAINED, WINDOW, SetDemand, own_runner

    hot, cold = (("/m/l1.gguf", 1.0),), (("/m/l2.gguf", 1.0),)
    busy = [SetDemand(hot, full=WINDOW, share=0.6), SetDemand(cold, full=0.0, share=0.4)]
    assert own_runner(busy, fits=True, load_seconds=1.0) == hot
    assert own_runner(busy, fits=False, load_seconds=1.0) is None  # no room: never evicts for it
    assert own_runner(busy, fits=True, load_seconds=30.0) is None  # the load would not pay within the window
    assert own_runner(busy[:1], fits=True, load_seconds=1.0) is None  # alone on its runner: nothing interleaves
    short = [SetDemand(hot, full=SUSTAINED * WINDOW * 0.9, share=0.6), busy[1]]
    assert own_runner(short, fits=True, load_seconds=1.0) is None  # not sustained
    assert own_runner(busy, fits=True, load_seconds=1.0, price=1.0) is None  # turns cost nothing: no gain


def _est(gib: float) -> MemoryEstimate:
    b = int(gib * 1024**3)
    return MemoryEstimate(weights=b, kv=0, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=(b,))


def _machine(gib: float, max_loaded: int = 3) -> Machine:
    from trioshed.core.model import Device

    gpu = Device("cuda:0", "cuda", 0, int(gib * 1024**3), int(gib * 1024**3))
    return Machine(gpus=(gpu,), system=Device("cpu", "cpu", 0, 0, 0), max_loaded=max_loaded)


def test_a_group_too_large_for_the_memory_is_served_by_a_runner_of_the_model_s_own_adapters() -> None:
    a2 = spec("a2", "/m/l2.gguf")
    request = RequestView(1, a2, RunnerOptions(), _est(12), alone_estimate=_est(6))
    actions = plan([request], [], _machine(8), place=simple_place, now=0.0)
    assert len(actions) == 1 and isinstance(actions[0], Load)
    assert actions[0].model is not None and actions[0].model.adapters == ("/m/l2.gguf",)
    # where the group fits, its runner: every adapter
    actions = plan([request], [], _machine(16), place=simple_place, now=0.0)
    assert isinstance(actions[0], Load) and actions[0].model is None
    # and the smaller runner serves only its model: a1 waits for another
    a1 = RequestView(2, spec("a1", "/m/l1.gguf"), RunnerOptions(), _est(12), alone_estimate=_est(6))
    actions = plan([request, a1], [], _machine(8, max_loaded=1), place=simple_place, now=0.0)
    assert [type(a) for a in actions] == [Load]


def test_a_grown_group_loads_beside_the_old_runner_and_supersedes_it_once_ready() -> None:
    old = RunnerView(1, runner_model(spec("a1", "/m/l1.gguf")), RunnerOptions(), RunnerState.READY, leases=1, usage=(("cuda:0", 4 * 1024**3),))
    grown = (*GROUP, "/m/l4.gguf")
    a4 = RequestView(2, spec("a4", "/m/l4.gguf", group=grown), RunnerOptions(), _est(4))
    actions = plan([a4], [old], _machine(16), place=simple_place, now=0.0)
    assert [type(a) for a in actions] == [Load]  # beside, the old one untouched
    new = RunnerView(3, runner_model(a4.model), RunnerOptions(), RunnerState.READY, usage=(("cuda:0", 4 * 1024**3),))
    a1 = RequestView(4, replace(spec("a1", "/m/l1.gguf"), group=grown), RunnerOptions(), _est(4))
    actions = plan([a1], [old, new], _machine(16), place=simple_place, now=0.0)
    assert actions[0] == Evict(1, "its group grew: a runner with more adapters serves its models")
    assert actions[1:] == [Dispatch(4, 3)]
    # no room beside it: a swap, once the old one's request ends
    actions = plan([a4], [old], _machine(6), place=simple_place, now=0.0)
    assert [type(a) for a in actions] == [Evict]


def test_the_demand_meter_reads_a_set_that_fills_the_slots_as_full() -> None:
    from trioshed.core.own_runner import WINDOW, DemandMeter

    hot, cold = (("/m/l1.gguf", 1.0),), (("/m/l2.gguf", 1.0),)
    meter = DemandMeter()
    meter.update(0.0, {hot: (2, 3), cold: (0, 1)}, slots=2)
    later = {d.adapters: d for d in meter.demand(10 * WINDOW)}
    assert later[hot].full == pytest.approx(WINDOW, rel=1e-3) and later[hot].share == pytest.approx(1.0, rel=1e-3)
    assert cold not in later  # it never had the slots' worth of requests, nor a slot
    meter.update(10 * WINDOW, {}, slots=2)
    assert all(d.full < 1e-3 * WINDOW for d in meter.demand(30 * WINDOW))  # forgotten once it stops


def test_a_hot_set_s_own_runner_loads_beside_its_group_s_and_takes_its_requests_first() -> None:
    from trioshed.core.own_runner import WINDOW, SetDemand

    hot = adapter_set(spec("a1", "/m/l1.gguf"))
    demand = (SetDemand(hot, WINDOW, 0.6), SetDemand(adapter_set(spec("a2", "/m/l2.gguf")), 0.0, 0.4))
    group = RunnerView(1, runner_model(spec("a1", "/m/l1.gguf")), RunnerOptions(num_parallel=2), RunnerState.READY, leases=2,
                       usage=(("cuda:0", 4 * 1024**3),), turns=Turns(), demand=demand, load_seconds=1.0)  # fmt: skip
    a1 = RequestView(2, spec("a1", "/m/l1.gguf"), RunnerOptions(num_parallel=2), _est(4), alone_estimate=_est(3))
    actions = plan([a1], [group], _machine(16), place=simple_place, now=0.0)
    assert len(actions) == 1 and isinstance(actions[0], Load) and actions[0].model is not None
    assert actions[0].model.adapters == ("/m/l1.gguf",)
    assert plan([a1], [group], _machine(6), place=simple_place, now=0.0) == []  # no room beside: it waits
    own = RunnerView(3, actions[0].model, RunnerOptions(num_parallel=2), RunnerState.READY, usage=(("cuda:0", 3 * 1024**3),), own=True)
    free = replace(group, leases=0)
    assert plan([a1], [free, own], _machine(16), place=simple_place, now=0.0) == [Dispatch(2, 3)]
    a2 = RequestView(4, spec("a2", "/m/l2.gguf"), RunnerOptions(num_parallel=2), _est(4), alone_estimate=_est(3))
    assert plan([a2], [free, own], _machine(16), place=simple_place, now=0.0) == [Dispatch(4, 1)]
