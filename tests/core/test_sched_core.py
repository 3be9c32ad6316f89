"""Pure tests of the planner's decisions (trioshed.core.sched): no trio, no clock, no processes."""

from __future__ import annotations

from dataclasses import replace

from trioshed.core.model import Device, MemoryEstimate, ModelSpec, RunnerOptions
from trioshed.core.sched import (
    Dispatch,
    Evict,
    Fail,
    Load,
    Machine,
    RequestView,
    RunnerState,
    RunnerView,
    can_serve,
    default_max_loaded,
    plan,
    victim_order,
)
from trioshed.errors import InsufficientMemory, LoadCooldown
from trioshed.testing.fake import simple_place

GiB = 1024**3


def model(name: str, **kw: object) -> ModelSpec:
    return ModelSpec(f"{name}:latest", f"/m/{name}.gguf", **kw)  # type: ignore[arg-type]


def est(gib: float) -> MemoryEstimate:
    b = int(gib * GiB)
    return MemoryEstimate(weights=b, kv=0, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=(b,))


def req(i: int, name: str, gib: float = 1, **opts: object) -> RequestView:
    return RequestView(i, model(name), RunnerOptions(**opts), est(gib))  # type: ignore[arg-type]


def runner(i: int, name: str, gib: float, *, state: RunnerState = RunnerState.READY, leases: int = 0,
           keep_alive: float = 300, last_used: float = 0, evicting: bool = False, device: str = "cuda:0",
           **opts: object) -> RunnerView:  # fmt: skip
    return RunnerView(i, model(name), RunnerOptions(**opts), state, leases, evicting, keep_alive,  # type: ignore[arg-type]
                      last_used, ((device, int(gib * GiB)),))  # fmt: skip


def machine(*gpus: float, system: float = 2, max_loaded: int = 3) -> Machine:
    return Machine(
        gpus=tuple(Device(f"cuda:{i}", "cuda", i, int(g * GiB), int(g * GiB)) for i, g in enumerate(gpus)),
        system=Device("cpu", "cpu", 0, int(system * GiB), int(system * GiB)),
        max_loaded=max_loaded,
    )


def run(requests: list[RequestView], runners: list[RunnerView], m: Machine, **kw: object) -> list[object]:
    return plan(requests, runners, m, place=simple_place, now=100.0, **kw)  # type: ignore[arg-type]


def test_loaded_runner_is_dispatched_and_slots_are_respected() -> None:
    actions = run([req(1, "a"), req(2, "a")], [runner(7, "a", 4)], machine(24))
    assert actions == [Dispatch(1, 7)]  # one slot: the second waits


def test_two_requests_for_an_unloaded_model_share_one_load() -> None:
    actions = run([req(1, "a", 4), req(2, "a", 4)], [], machine(24))
    assert len(actions) == 1 and isinstance(actions[0], Load) and actions[0].request == 1


def test_best_fit_goes_to_the_emptiest_gpu() -> None:
    actions = run([req(1, "b", 4)], [runner(7, "a", 10, device="cuda:0")], machine(16, 16))
    assert isinstance(actions[0], Load) and actions[0].placement.devices == ("cuda:1",)


def test_victims_idle_first_then_shortest_keep_alive_then_least_recent() -> None:
    views = [
        runner(1, "busy", 1, leases=1, keep_alive=1),
        runner(2, "long", 1, keep_alive=600, last_used=1),
        runner(3, "short-old", 1, keep_alive=60, last_used=1),
        runner(4, "short-new", 1, keep_alive=60, last_used=5),
    ]
    assert [v.id for v in sorted(views, key=victim_order)] == [3, 4, 2, 1]


def test_at_max_loaded_one_idle_victim_is_evicted_and_memory_reserved() -> None:
    runners = [runner(1, "a", 1), runner(2, "b", 1, leases=1)]
    actions = run([req(9, "c", 1), req(10, "d", 1)], runners, machine(24, max_loaded=2))
    # c takes a's place (reserved: a's GPU memory is awaited); d then needs b's, which unloads
    # when its lease ends
    assert actions == [Evict(1, "make room for c:latest"), Evict(2, "make room for d:latest")]
    assert run([req(9, "c", 1)], runners, machine(24, max_loaded=2)) == [Evict(1, "make room for c:latest")]


def test_at_max_loaded_on_the_cpu_an_idle_victim_is_evicted_and_the_request_loads_beside_its_exit() -> None:
    runners = [runner(1, "a", 1, device="cpu"), runner(2, "b", 1, leases=1, device="cpu")]
    actions = run([req(9, "c", 1), req(10, "d", 1)], runners, machine(system=24, max_loaded=2))
    # c takes idle a's place at once (a is stopped in the same pass, memory fits both meanwhile);
    # d then needs b's place, which is freed only when b's lease ends: d reserves and waits.
    assert [type(a) for a in actions] == [Evict, Load, Evict]
    assert actions[0] == Evict(1, "make room for c:latest") and actions[1].request == 9
    assert actions[2] == Evict(2, "make room for d:latest")
    assert [w.request for w in actions.waits if w.reserved] == [10]


def test_a_gpu_swap_waits_for_the_victims_memory_even_when_both_would_fit() -> None:
    # The freed GPU memory is awaited (VRAM recovery) before the next load, as in the reference.
    actions = run([req(9, "c", 1)], [runner(1, "a", 1)], machine(24, max_loaded=1))
    assert actions == [Evict(1, "make room for c:latest")]


def test_a_swap_waits_for_the_victims_exit_when_memory_does_not_fit_both() -> None:
    # 24 GiB of system memory: a (16, idle) must leave before c (16) fits: evict, reserve, wait.
    actions = run([req(9, "c", 16)], [runner(1, "a", 16, device="cpu")], machine(system=24, max_loaded=1))
    assert actions == [Evict(1, "make room for c:latest")]
    assert [w.request for w in actions.waits if w.reserved] == [9]


def test_only_needed_victims_are_evicted() -> None:
    # 24 GiB: a (16, busy) and b (4, idle). c needs 16: evicting b alone does not help.
    runners = [runner(1, "a", 16, leases=1), runner(2, "b", 4)]
    actions = run([req(9, "c", 16)], runners, machine(24))
    assert actions == [Evict(1, "make room for c:latest")]


def test_pending_evictions_are_not_repeated() -> None:
    runners = [runner(1, "a", 16, leases=1, evicting=True)]
    assert run([req(9, "c", 16)], runners, machine(24)) == []


def test_victim_takes_no_new_leases() -> None:
    runners = [runner(1, "a", 16, evicting=True, leases=1, num_parallel=4)]
    assert run([req(9, "a", 16, num_parallel=4)], runners, machine(24)) == []


def test_too_big_fails_at_once_with_numbers() -> None:
    actions = run([req(1, "huge", 40)], [runner(2, "a", 1)], machine(24, system=8))
    assert len(actions) == 1 and isinstance(actions[0], Fail)
    error = actions[0].error
    assert isinstance(error, InsufficientMemory) and error.needed == 40 * GiB and error.available == 24 * GiB


def test_cooldown_fails_with_retry_after() -> None:
    actions = run([req(1, "bad")], [], machine(24), cooldowns={"/m/bad.gguf": (130.0, "boom")})
    assert isinstance(actions[0], Fail) and isinstance(actions[0].error, LoadCooldown)
    assert actions[0].error.headers["Retry-After"] == "30"
    assert isinstance(run([req(1, "bad")], [], machine(24), cooldowns={"/m/bad.gguf": (99.0, "x")})[0], Load)


def test_incompatible_runner_is_evicted_for_reload_and_loading_one_is_waited_for() -> None:
    ready = runner(1, "a", 1, num_ctx=2048)
    assert run([req(9, "a", num_ctx=8192)], [ready], machine(24)) == [Evict(1, "reload: options changed")]
    loading = replace(ready, state=RunnerState.LOADING)
    assert run([req(9, "a", num_ctx=8192)], [loading], machine(24)) == []


def test_can_serve_rules() -> None:
    r = runner(1, "a", 1, num_ctx=8192, num_gpu=10)
    assert can_serve(r, model("a"), RunnerOptions(num_ctx=4096, num_gpu=-1))
    assert not can_serve(r, model("a"), RunnerOptions(num_ctx=16384, num_gpu=10))
    assert not can_serve(r, model("a"), RunnerOptions(num_ctx=8192, num_gpu=5))
    assert not can_serve(r, model("a", adapters=("/l.gguf",)), RunnerOptions(num_ctx=8192, num_gpu=10))
    assert not can_serve(r, model("a", projector="/p.gguf"), RunnerOptions(num_ctx=8192, num_gpu=10))


def test_cpu_only_is_limited_by_system_memory_and_max_loaded() -> None:
    m = machine(system=8, max_loaded=3)
    assert isinstance(run([req(1, "a", 6)], [], m)[0], Load)
    actions = run([req(1, "b", 6)], [runner(2, "a", 6, device="cpu")], m)
    assert actions == [Evict(2, "make room for b:latest")]


def test_default_max_loaded() -> None:
    assert default_max_loaded(0, 0) == 3 and default_max_loaded(0, 2) == 6 and default_max_loaded(5, 2) == 5


def test_with_others_loaded_a_model_makes_room_rather_than_spill_to_cpu() -> None:
    # 24 GiB GPU holds a (16); b (16) would fit in system memory, but alone it fits the GPU.
    m = machine(24, system=64)
    assert run([req(9, "b", 16)], [runner(1, "a", 16)], m) == [Evict(1, "make room for b:latest")]
    # Nothing in the way: CPU is used when the GPU cannot hold it even alone.
    actions = run([req(9, "big", 40)], [], m)
    assert isinstance(actions[0], Load) and actions[0].placement.on_cpu_only


def test_memory_taken_by_other_programs_fails_at_once_or_spills() -> None:
    busy_gpu = Machine(
        gpus=(Device("cuda:0", "cuda", 0, 24 * GiB, 4 * GiB),),  # NVML: 20 GiB used by others
        system=Device("cpu", "cpu", 0, 8 * GiB, 8 * GiB),
        max_loaded=3,
    )
    actions = run([req(1, "a", 16)], [], busy_gpu)
    assert isinstance(actions[0], Fail) and isinstance(actions[0].error, InsufficientMemory)
    assert "other programs" in actions[0].error.message
    actions = run([req(1, "a", 6)], [], busy_gpu)  # fits in system memory meanwhile
    assert isinstance(actions[0], Load) and actions[0].placement.on_cpu_only


def test_embedding_runner_serves_generation_but_not_the_reverse() -> None:
    emb = runner(1, "a", 1, embedding=True)
    gen = runner(2, "a", 1)
    assert can_serve(emb, model("a"), RunnerOptions())
    assert not can_serve(gen, model("a"), RunnerOptions(embedding=True))


# -- a request that fits now loads at once, even while another waits for room --------


def test_fits_now_beside_one_reservation_loads_at_once() -> None:
    # The shape: tiny (forever) and big (streaming) loaded; big2 waits for big to go.
    # gamma fits in what is free now and still fits once big is gone and big2 is loaded.
    m = machine(1 + 8 + 4 + 0.6, max_loaded=4)
    runners = [runner(1, "tiny", 1, keep_alive=float("inf")), runner(2, "big", 8, leases=1)]
    actions = run([req(9, "big2", 8), req(10, "gamma", 0.5)], runners, m)
    assert actions[0] == Evict(2, "make room for big2:latest")
    assert len(actions) == 2 and isinstance(actions[1], Load) and actions[1].request == 10


def test_fits_now_beside_two_reservations_loads_at_once() -> None:
    # 24 GiB: a (10, busy) and b (10, busy) loaded; c (10) and d (10) each make room.
    # e (2) fits in the 4 GiB free now and beside c and d once a and b are gone.
    runners = [runner(1, "a", 10, leases=1), runner(2, "b", 10, leases=1)]
    actions = run([req(8, "c", 10), req(9, "d", 10), req(10, "e", 2)], runners, machine(24, max_loaded=5))
    assert actions[:2] == [Evict(1, "make room for c:latest"), Evict(2, "make room for d:latest")]
    assert len(actions) == 3 and isinstance(actions[2], Load) and actions[2].request == 10


def test_fits_now_but_not_beside_the_reservation_waits() -> None:
    # e (3) fits in the 4 GiB free now, but not beside c (12) once a is gone: it must not take
    # the memory c waits for.
    runners = [runner(1, "a", 10, leases=1), runner(2, "b", 10, leases=1)]
    actions = run([req(8, "c", 12), req(10, "e", 3)], runners, machine(24, max_loaded=5))
    assert Evict(1, "make room for c:latest") in actions
    assert not any(isinstance(a, Load) for a in actions)


def test_partial_offload_request_loads_beside_a_reservation() -> None:
    # Real placement; the request asks for 4 of 13 layers on the GPU (num_gpu=4). 12 GiB GPU:
    # a (6, busy) now, b (7) once a is gone; 4 layers + compute (under 5 GiB) fit both states.
    from trioshed.core.placement import place

    big = MemoryEstimate(weights=12 * GiB, kv=0, output=GiB // 4, token_embd=GiB // 4, compute_full=GiB // 4,
                         compute_partial=GiB // 4, layers=(GiB,) * 12)  # fmt: skip
    m = machine(12, system=64, max_loaded=4)
    runners = [runner(1, "a", 6, leases=1)]
    requests = [req(8, "b", 7), RequestView(9, model("huge"), RunnerOptions(num_gpu=4), big)]
    actions = plan(requests, runners, m, place=place, now=100.0)
    assert actions[0] == Evict(1, "make room for b:latest")
    load = actions[1]
    assert len(actions) == 2 and isinstance(load, Load) and load.request == 9
    assert load.placement.n_gpu_layers == 4 and 3 * GiB <= load.placement.vram_total <= 12 * GiB - 7 * GiB


def test_cpu_only_machine_fits_now_beside_a_reservation() -> None:
    m = machine(system=16, max_loaded=4)
    runners = [runner(1, "a", 8, leases=1, device="cpu")]
    actions = run([req(8, "b", 10), req(9, "c", 4), req(10, "d", 4)], runners, m)
    assert actions[0] == Evict(1, "make room for b:latest")
    # c (4) fits now (8 free) and beside b (10) after; d would not fit beside b and c after.
    assert len(actions) == 2 and isinstance(actions[1], Load) and actions[1].request == 9
