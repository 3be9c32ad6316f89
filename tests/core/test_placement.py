"""Placement over declared inventories: one GPU, a proportional split, partial offload, failures."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioshed.core.model import Device, DoesNotFit, GiB, MemoryEstimate, Placement
from trioshed.core.placement import capacity, gpu_layer_count, place, split_layers

# Ten 1 GiB layers, a 1 GiB output layer, 0.5 GiB input layer, 1 GiB graph:
# full offload is 12 GiB on the GPU and 0.5 GiB in system memory.
EST = MemoryEstimate(
    weights=10 * GiB,
    kv=0,
    output=1 * GiB,
    token_embd=GiB // 2,
    compute_full=1 * GiB,
    compute_partial=1 * GiB,
    layers=(1 * GiB,) * 10,
)
TIED = MemoryEstimate(
    weights=10 * GiB,
    kv=0,
    output=1 * GiB,
    token_embd=1 * GiB,
    compute_full=1 * GiB,
    compute_partial=1 * GiB,
    layers=(1 * GiB,) * 10,
    output_shared=1 * GiB,
)


def gpu(id_: str, free_gib: float, total_gib: float = 24) -> Device:
    library, index = id_.split(":")
    return Device(id_, library, int(index), int(total_gib * GiB), int(free_gib * GiB))


@dataclass
class Case:
    name: str
    gpus: list[Device]
    system_free: float = 64
    num_gpu: int = -1
    spread: bool = False
    overhead: float = 0
    est: MemoryEstimate = EST
    # expectations
    n_gpu_layers: int | None = None
    devices: tuple[str, ...] = ()
    vram: dict[str, float] = field(default_factory=dict)
    ram: float | None = None
    tensor_split: tuple[float, ...] | None = None
    fails: bool = False
    needed: float | None = None
    available: float | None = None


CASES = [
    Case(
        "fits-on-the-emptiest-single-gpu",
        [gpu("cuda:0", 16), gpu("cuda:1", 20), gpu("cuda:2", 13)],
        n_gpu_layers=11,
        devices=("cuda:1",),
        vram={"cuda:1": 12},
        ram=0.5,
    ),
    Case(
        "needs-two-gpus-proportional-split",
        [gpu("cuda:0", 8), gpu("cuda:1", 8)],
        n_gpu_layers=11,
        devices=("cuda:0", "cuda:1"),
        # layers 0-5 on cuda:0 (6 + 1 compute), layers 6-9 + output on cuda:1 (5 + 1 compute)
        vram={"cuda:0": 7, "cuda:1": 6},
        tensor_split=(0.5, 0.5),
        ram=0.5,
    ),
    Case(
        "uneven-split-follows-free-memory",
        [gpu("cuda:0", 4), gpu("cuda:1", 10)],
        n_gpu_layers=11,
        devices=("cuda:0", "cuda:1"),
        # split (4-1):(10-1) of the 11 offloaded layers: 3 + graph, then 7 + output + graph
        vram={"cuda:0": 4, "cuda:1": 9},
        tensor_split=(0.25, 0.75),
        ram=0.5,
    ),
    Case(
        "partial-offload-most-layers-that-fit",
        [gpu("cuda:0", 6)],
        n_gpu_layers=5,
        devices=("cuda:0",),
        vram={"cuda:0": 6},
        # input 0.5 + layers 0-4 (5) + output 1 + CPU graph 1
        ram=7.5,
    ),
    Case(
        "partial-offload-over-two-gpus",
        [gpu("cuda:0", 4), gpu("cuda:1", 4)],
        n_gpu_layers=6,
        devices=("cuda:0", "cuda:1"),
        vram={"cuda:0": 4, "cuda:1": 4},
        ram=6.5,
        tensor_split=(0.5, 0.5),
    ),
    Case(
        "no-gpus-runs-on-cpu",
        [],
        n_gpu_layers=0,
        ram=12.5,
    ),
    Case(
        "num-gpu-0-forces-cpu",
        [gpu("cuda:0", 24)],
        num_gpu=0,
        n_gpu_layers=0,
        ram=12.5,
    ),
    Case(
        "tied-embeddings-cost-nothing-extra-on-cpu",
        [],
        est=TIED,
        n_gpu_layers=0,
        ram=12,  # total 13 (10 layers, input 1, output 1, graph 1) less the shared output copy
    ),
    Case(
        "num-gpu-n-exactly-n-layers",
        [gpu("cuda:0", 24), gpu("cuda:1", 20)],
        num_gpu=3,
        n_gpu_layers=3,
        devices=("cuda:0",),
        vram={"cuda:0": 4},
        ram=9.5,
    ),
    Case(
        "num-gpu-above-layer-count-is-full-offload",
        [gpu("cuda:0", 24)],
        num_gpu=99,
        n_gpu_layers=11,
        devices=("cuda:0",),
        vram={"cuda:0": 12},
        ram=0.5,
    ),
    Case(
        "num-gpu-n-that-does-not-fit-fails",
        [gpu("cuda:0", 4)],
        num_gpu=8,
        fails=True,
        needed=12.5,
        available=4,
    ),
    Case(
        "does-not-fit-anywhere",
        [gpu("cuda:0", 2)],
        system_free=4,
        fails=True,
        needed=12.5,
        available=4,
    ),
    Case(
        "cpu-only-does-not-fit",
        [],
        system_free=8,
        fails=True,
        needed=12.5,
        available=8,
    ),
    Case(
        "overhead-turns-full-into-partial",
        [gpu("cuda:0", 12.5)],
        overhead=1,
        n_gpu_layers=10,
        devices=("cuda:0",),
        vram={"cuda:0": 11},
        ram=2.5,
    ),
    Case(
        "overhead-honoured-per-gpu-in-a-split",
        [gpu("cuda:0", 8), gpu("cuda:1", 8)],
        overhead=1,
        n_gpu_layers=11,
        devices=("cuda:0", "cuda:1"),
        vram={"cuda:0": 7, "cuda:1": 6},
        ram=0.5,
        tensor_split=(0.5, 0.5),
    ),
    Case(
        "spread-uses-every-gpu",
        [gpu("cuda:0", 20), gpu("cuda:1", 20)],
        spread=True,
        n_gpu_layers=11,
        devices=("cuda:0", "cuda:1"),
        vram={"cuda:0": 7, "cuda:1": 6},
        ram=0.5,
        tensor_split=(0.5, 0.5),
    ),
    Case(
        "libraries-are-not-mixed",
        [gpu("cuda:0", 8), gpu("rocm:0", 8)],
        n_gpu_layers=7,
        devices=("cuda:0",),
        vram={"cuda:0": 8},
        ram=5.5,
    ),
    Case(
        "partial-offload-needs-system-memory-too",
        [gpu("cuda:0", 6)],
        system_free=7,
        fails=True,
        needed=12.5,
        available=7,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_place(case: Case) -> None:
    result = place(
        case.est,
        case.gpus,
        system_free=int(case.system_free * GiB),
        num_gpu=case.num_gpu,
        spread=case.spread,
        overhead=int(case.overhead * GiB),
    )
    if case.fails:
        assert isinstance(result, DoesNotFit), result
        assert result.needed == int(case.needed * GiB)
        assert result.available == int(case.available * GiB)
        assert result.reason
        return
    assert isinstance(result, Placement), result
    assert result.n_gpu_layers == case.n_gpu_layers
    assert result.devices == case.devices
    assert dict(result.vram) == {k: int(v * GiB) for k, v in case.vram.items()}
    assert result.ram == int(case.ram * GiB)
    assert result.tensor_split == case.tensor_split
    if len(case.devices) > 1:
        assert result.main_gpu == 0
    # Nothing predicted beyond what the devices offer.
    for dev_id, b in result.vram:
        d = next(d for d in case.gpus if d.id == dev_id)
        assert b <= d.free - int(case.overhead * GiB)
    assert result.ram <= int(case.system_free * GiB)


def test_output_layer_counts_as_layer_n() -> None:
    assert gpu_layer_count(EST) == 11
    assert split_layers(10, 11, [1.0]) == [list(range(11))]
    # llama.cpp b10068 offloads the output layer first: -ngl k puts the output layer and the
    # last k - 1 repeating layers on the GPUs (checked against the real build, over an RPC
    # server, in tests/e2e/test_rpc_e2e.py::test_split_layers_matches_the_pinned_llama_cpp)
    assert split_layers(10, 10, [1.0]) == [list(range(1, 11))]
    assert split_layers(10, 3, [1.0]) == [[8, 9, 10]]
    assert split_layers(10, 1, [1.0]) == [[10]]
    assert split_layers(10, 0, [1.0]) == [[]]


def test_split_matches_llama_cpp_rule() -> None:
    # llama.cpp: layer il -> first device whose cumulative split exceeds (il - start) / act
    assert split_layers(10, 11, [1, 1]) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert split_layers(10, 11, [1, 3]) == [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
    assert split_layers(4, 5, [1, 0, 1]) == [[0, 1, 2], [], [3, 4]]


def test_capacity_ignores_what_is_loaded() -> None:
    busy = [gpu("cuda:0", 1, total_gib=16)]
    assert isinstance(place(EST, busy, system_free=1 * GiB), DoesNotFit)
    p = capacity(EST, busy, system_total=64 * GiB, overhead=GiB)
    assert isinstance(p, Placement)
    assert p.n_gpu_layers == 11 and p.devices == ("cuda:0",)


def test_cpu_devices_in_the_list_are_ignored() -> None:
    cpu = Device("cpu", "cpu", 0, 64 * GiB, 64 * GiB)
    p = place(EST, [cpu], system_free=64 * GiB)
    assert isinstance(p, Placement) and p.on_cpu_only and p.ram == EST.cpu_total


def test_full_offload_keeps_the_input_layer_in_system_memory() -> None:
    p = place(TIED, [gpu("cuda:0", 24)], system_free=64 * GiB)
    assert isinstance(p, Placement)
    assert p.ram == TIED.token_embd
    # the tied output copy is real on the GPU
    assert dict(p.vram)["cuda:0"] == 10 * GiB + 1 * GiB + 1 * GiB


@settings(max_examples=300, deadline=None)
@given(
    layers=st.lists(st.integers(1, 4 * GiB), min_size=1, max_size=40),
    output=st.integers(0, 2 * GiB),
    token_embd=st.integers(0, 2 * GiB),
    compute=st.integers(0, 2 * GiB),
    frees=st.lists(st.integers(0, 80 * GiB), min_size=0, max_size=4),
    system_free=st.integers(0, 128 * GiB),
    overhead=st.integers(0, 2 * GiB),
    num_gpu=st.integers(-1, 45),
    spread=st.booleans(),
)
def test_place_never_overcommits(
    layers, output, token_embd, compute, frees, system_free, overhead, num_gpu, spread
) -> None:
    est = MemoryEstimate(
        weights=sum(layers),
        kv=0,
        output=output,
        token_embd=token_embd,
        compute_full=compute,
        compute_partial=compute,
        layers=tuple(layers),
    )
    gpus = [Device(f"cuda:{i}", "cuda", i, 80 * GiB, f) for i, f in enumerate(frees)]
    result = place(
        est, gpus, system_free=system_free, num_gpu=num_gpu, spread=spread, overhead=overhead
    )
    if isinstance(result, DoesNotFit):
        assert result.needed > 0 and result.reason
        return
    assert 0 <= result.n_gpu_layers <= len(layers) + 1
    if num_gpu > 0 and gpus:
        assert result.n_gpu_layers == min(num_gpu, len(layers) + 1)
    if num_gpu == 0 or not gpus:
        assert result.on_cpu_only and result.ram == est.cpu_total
    assert result.ram <= system_free
    free = {d.id: d.free - overhead for d in gpus}
    for dev_id, b in result.vram:
        assert b <= free[dev_id]
    # Every byte is somewhere: the devices and system memory hold at least the model.
    assert result.total >= est.weights + est.output + est.token_embd - est.output_shared
