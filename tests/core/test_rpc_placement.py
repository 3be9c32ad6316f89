"""Placement over RPC servers (pure): local first, then as few remote layers and servers as
needed; one runner per RPC server; 503 when a model fits only with a server that is down; the
llama-server flags built from such a placement."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.core.test_placement import (
    EST,  # ten 1 GiB layers, 1 GiB output, 0.5 GiB input, 1 GiB graph
)
from trioshed.core.model import (
    Device,
    DoesNotFit,
    GiB,
    ModelSpec,
    Placement,
    RunnerOptions,
)
from trioshed.core.placement import capacity, place, split_layers
from trioshed.core.sched import (
    Fail,
    Load,
    Machine,
    RequestView,
    RunnerState,
    RunnerView,
    plan,
    usage_of,
)
from trioshed.errors import InsufficientMemory, RemoteUnavailable
from trioshed.runner.command import build_command, device_names


def gpu(index: int, free_gib: float, total_gib: float = 24) -> Device:
    return Device(f"cuda:{index}", "cuda", index, int(total_gib * GiB), int(free_gib * GiB))


def rpc(port: int, free_gib: float, index: int = 0) -> Device:
    size = int(free_gib * GiB)
    return Device(f"rpc:10.0.0.{index + 2}:{port}", "rpc", index, size, size, name=f"10.0.0.{index + 2}:{port}")


def layers_on(p: Placement) -> dict[str, int]:
    return dict(zip(p.devices, p.layers, strict=True))


def test_a_model_that_fits_locally_never_touches_an_rpc_server() -> None:
    p = place(EST, [gpu(0, 16), rpc(50052, 24)], system_free=64 * GiB)
    assert isinstance(p, Placement)
    assert p.devices == ("cuda:0",) and p.endpoints == () and p.n_gpu_layers == 11


def test_too_big_locally_spans_local_first_then_both_servers() -> None:
    # local: 6 GiB - 1 GiB graph = 5 layers; each server: 4 - 1 = 3 layers; 5 + 3 + 3 = 11
    a, b = rpc(50052, 4, 0), rpc(50053, 4, 1)
    p = place(EST, [gpu(0, 6), a, b], system_free=64 * GiB)
    assert isinstance(p, Placement)
    assert p.n_gpu_layers == 11
    assert p.devices == ("cuda:0", a.id, b.id)
    assert p.layers == (5, 3, 3) and p.tensor_split == (5.0, 3.0, 3.0)
    assert p.endpoints == ("10.0.0.2:50052", "10.0.0.3:50053")
    # llama.cpp's own split rule assigns exactly these layers (the output layer, 10, last)
    assert split_layers(10, 11, p.tensor_split) == [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]
    assert dict(p.vram) == {"cuda:0": 6 * GiB, a.id: 4 * GiB, b.id: 4 * GiB}
    assert p.ram == GiB // 2


def test_never_more_remote_than_needed_one_server_when_one_is_enough() -> None:
    small, big = rpc(50052, 4, 0), rpc(50053, 8, 1)
    p = place(EST, [gpu(0, 6), small, big], system_free=64 * GiB)
    assert isinstance(p, Placement)
    # the local GPU is filled (5 layers); the 6 left go to the server with the most room alone
    assert layers_on(p) == {"cuda:0": 5, big.id: 6}
    assert small.id not in p.devices


def test_without_local_gpus_the_cpu_comes_first_then_rpc_when_memory_is_short() -> None:
    server = rpc(50052, 24)
    on_cpu = place(EST, [server], system_free=64 * GiB)
    assert isinstance(on_cpu, Placement) and on_cpu.on_cpu_only
    remote = place(EST, [server], system_free=2 * GiB)
    assert isinstance(remote, Placement)
    assert remote.devices == (server.id,) and remote.layers == (11,) and remote.ram == GiB // 2


def test_num_gpu_0_stays_on_the_cpu() -> None:
    p = place(EST, [gpu(0, 2), rpc(50052, 24)], system_free=64 * GiB, num_gpu=0)
    assert isinstance(p, Placement) and p.on_cpu_only


def test_partial_span_puts_the_rest_on_the_cpu_when_servers_are_small() -> None:
    a, b = rpc(50052, 2, 0), rpc(50053, 2, 1)
    p = place(EST, [gpu(0, 6), a, b], system_free=64 * GiB)
    assert isinstance(p, Placement)
    # 5 local + 1 + 1 remote = 7 of 11 (more than the 5 the local GPU alone holds)
    assert p.n_gpu_layers == 7 and p.layers == (5, 1, 1)
    assert p.ram > GiB // 2


def test_nothing_fits_says_so_with_the_servers_named() -> None:
    result = place(EST, [gpu(0, 1.5), rpc(50052, 1.5)], system_free=1 * GiB)
    assert isinstance(result, DoesNotFit)
    assert "10.0.0.2:50052" in result.reason


def test_capacity_counts_the_servers_totals() -> None:
    busy = replace(rpc(50052, 8), free=0)
    assert isinstance(capacity(EST, [gpu(0, 0, total_gib=6), busy], system_total=2 * GiB), Placement)


# -- the planner ---------------------------------------------------------------------------------


def spec(name: str) -> ModelSpec:
    return ModelSpec(name=f"{name}:latest", path=f"/models/{name}.gguf")


def request(rid: int, name: str) -> RequestView:
    return RequestView(rid, spec(name), RunnerOptions(), EST)


def machine(*gpus: Device, system: float = 2, down: tuple[Device, ...] = ()) -> Machine:
    size = int(system * GiB)
    return Machine(gpus=gpus, system=Device("cpu", "cpu", 0, size, size), max_loaded=6, remote_down=down)


def test_two_runners_never_share_an_rpc_server() -> None:
    server = rpc(50052, 24)
    first = place(EST, [gpu(0, 6), server], system_free=2 * GiB)
    assert isinstance(first, Placement) and server.id in first.devices
    loaded = RunnerView(1, spec("a"), RunnerOptions(), RunnerState.READY, leases=1, usage=usage_of(first))
    # "b" would fit on the server's remaining 18 GiB, but the server has its one client: the
    # planner must not load "b" there while "a" (leased) holds it.
    actions = plan([request(10, "b")], [loaded], machine(gpu(0, 6, total_gib=6), server), place=place, now=0.0)
    assert not any(isinstance(a, Load) for a in actions), actions


def test_an_idle_runner_on_the_server_is_evicted_to_free_it() -> None:
    server = rpc(50052, 24)
    first = place(EST, [gpu(0, 6), server], system_free=2 * GiB)
    assert isinstance(first, Placement)
    idle = RunnerView(1, spec("a"), RunnerOptions(), RunnerState.READY, leases=0, usage=usage_of(first))
    actions = plan([request(10, "b")], [idle], machine(gpu(0, 6, total_gib=6), server), place=place, now=0.0)
    assert [type(a).__name__ for a in actions] == ["Evict"]


def test_two_requests_in_one_pass_get_different_servers() -> None:
    a, b = rpc(50052, 24, 0), rpc(50053, 24, 1)
    m = Machine(gpus=(a, b), system=Device("cpu", "cpu", 0, 2 * GiB, 2 * GiB), max_loaded=6)
    actions = plan([request(1, "x"), request(2, "y")], [], m, place=place, now=0.0)
    loads = [a for a in actions if isinstance(a, Load)]
    assert len(loads) == 2
    assert {loads[0].placement.endpoints, loads[1].placement.endpoints} == {("10.0.0.2:50052",), ("10.0.0.3:50053",)}


def test_fits_only_with_a_down_server_is_503_naming_it_else_507() -> None:
    up, down = rpc(50052, 4, 0), rpc(50053, 4, 1)
    dead = replace(down, name="10.0.0.3:50053 (connection refused)")
    actions = plan([request(1, "x")], [], machine(gpu(0, 6, total_gib=6), up, down=(dead,)), place=place, now=0.0)
    assert len(actions) == 1 and isinstance(actions[0], Fail)
    assert isinstance(actions[0].error, RemoteUnavailable) and actions[0].error.status == 503
    assert "10.0.0.3:50053 (connection refused)" in actions[0].error.message
    # too big even with the down server: 507
    tiny_down = replace(dead, total=GiB, free=GiB)
    actions = plan([request(1, "x")], [], machine(gpu(0, 6, total_gib=6), up, down=(tiny_down,)), place=place, now=0.0)
    assert isinstance(actions[0], Fail) and isinstance(actions[0].error, InsufficientMemory)


# -- the command line ----------------------------------------------------------------------------


def test_command_lists_rpc_servers_and_names_them_rpc0_rpc1() -> None:
    a, b = rpc(50052, 4, 0), rpc(50053, 4, 1)
    p = place(EST, [gpu(0, 6), a, b], system_free=64 * GiB)
    assert isinstance(p, Placement)
    argv = build_command("/bin/llama-server", spec("x"), RunnerOptions(), p, port=1)
    flag = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--rpc"] == "10.0.0.2:50052,10.0.0.3:50053"
    assert flag["--device"] == "CUDA0,RPC0,RPC1"
    assert flag["--tensor-split"] == "5,3,3"
    assert flag["--n-gpu-layers"] == "11"


def test_accounting_only_command_runs_the_local_share_on_the_cpu_and_the_remote_share_remote() -> None:
    a, b = rpc(50052, 4, 0), rpc(50053, 4, 1)
    p = place(EST, [gpu(0, 6), a, b], system_free=64 * GiB)
    assert isinstance(p, Placement)
    argv = build_command("/bin/llama-server", spec("x"), RunnerOptions(), p, port=1, accounting_only=True)
    flag = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--rpc"] == "10.0.0.2:50052,10.0.0.3:50053"
    assert flag["--device"] == "RPC0,RPC1"  # the declared GPU is not real: its layers stay on the CPU
    assert flag["--tensor-split"] == "3,3"
    assert flag["--n-gpu-layers"] == "6"  # the output layer and layers 5..9: the servers' share


def test_local_only_commands_are_unchanged() -> None:
    p = Placement(11, devices=("cuda:0",), vram=(("cuda:0", 12 * GiB),))
    argv = build_command("/bin/llama-server", spec("x"), RunnerOptions(), p, port=1)
    assert "--rpc" not in argv and argv[argv.index("--device") + 1] == "CUDA0"
    cpu = build_command("/bin/llama-server", spec("x"), RunnerOptions(), p, port=1, accounting_only=True)
    assert "--rpc" not in cpu and cpu[cpu.index("--device") + 1] == "none"


@pytest.mark.parametrize(
    ("devices", "names"),
    [
        (("cuda:0", "rpc:h:1", "rpc:h:2"), ["CUDA0", "RPC0", "RPC1"]),
        (("rpc:[::1]:5",), ["RPC0"]),
        (("vulkan:1",), ["Vulkan1"]),
    ],
)
def test_device_names(devices: tuple[str, ...], names: list[str]) -> None:
    assert device_names(devices) == names


def test_a_large_output_layer_goes_to_the_server_that_can_hold_it() -> None:
    big_output = replace(EST, output=4 * GiB)
    # local 6 GiB: 5 layers; A (4 GiB): 3 layers; B (8 GiB): the last 2 layers and the 4 GiB output.
    # Largest first (B then A) would leave the output on A, where it does not fit.
    a, b = rpc(50052, 4, 0), rpc(50053, 8, 1)
    p = place(big_output, [gpu(0, 6), a, b], system_free=64 * GiB)
    assert isinstance(p, Placement) and p.n_gpu_layers == 11
    assert layers_on(p) == {"cuda:0": 5, a.id: 3, b.id: 3}
    assert p.devices[-1] == b.id
