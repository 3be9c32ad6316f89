"""Vulkan device discovery (``trioshed.devices.vulkan``) and GPU placement terms, without a GPU.

Discovery runs a stand-in ``llama-server`` (a shell script printing ``--list-devices`` the way the
bundled build does, by ``GGML_VK_VISIBLE_DEVICES``): a real process, deterministic, on any machine.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from trioshed import devices as devices_module
from trioshed.core.estimate import estimate
from trioshed.core.model import Device, GiB, MemoryEstimate, MiB, Placement, RunnerOptions
from trioshed.core.placement import place
from trioshed.devices import DeviceSource, discover
from trioshed.devices.vulkan import (
    HARDWARE_MAX_TENSOR,
    SOFTWARE_MAX_TENSOR,
    list_runner_devices,
    parse_devices,
    same_card,
)
from trioshed.models.gguf_meta import read_metadata

LISTING = """\
Available devices:
  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 23871 MiB free)
  Vulkan1: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)
  RPC0: 10.0.0.2:50052 (16000 MiB, 15000 MiB free)
"""

# Physical devices 0 (an NVIDIA card) and 1 (lavapipe). Like llama.cpp: unset -> hardware only;
# an index names any device; an invalid index lists nothing.
FAKE = """#!/bin/sh
echo "Available devices:"
case "${GGML_VK_VISIBLE_DEVICES-unset}" in
  unset) echo "  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)";;
  0) echo "  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)";;
  1) echo "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)";;
  0,1) echo "  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)"
       echo "  Vulkan1: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)";;
  *) echo "ggml_vulkan: Invalid device index in GGML_VK_VISIBLE_DEVICES." >&2;;
esac
"""


@pytest.fixture
def fake_binary(tmp_path: Path) -> str:
    path = tmp_path / "llama-server"
    path.write_text(FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_module, "_nvml", lambda: None)


def test_list_devices_lines_are_parsed_with_their_backend_and_software_flag() -> None:
    listed = parse_devices(LISTING)
    assert [(d.name, d.total // MiB, d.free // MiB, d.software) for d in listed] == [
        ("Vulkan0", 24560, 23871, False),
        ("Vulkan1", 2048, 2048, True),
        ("RPC0", 16000, 15000, False),
    ]
    assert listed[0].description == "AMD Radeon RX 7900 XTX (RADV NAVI31)"


def test_software_devices_are_ignored_unless_asked_for(fake_binary: str, no_nvml: None) -> None:
    plain = discover(binary=fake_binary, env={})
    assert plain.kind == "vulkan" and [d.name for d in plain.gpus] == ["NVIDIA GeForce RTX 4090"]
    assert plain.runner_env == ()  # llama.cpp's own default selection: no variable set
    soft = discover(binary=fake_binary, env={}, vulkan_software=True)
    # every physical device found by its index, and the runners get the same numbering
    assert soft.runner_env == (("GGML_VK_VISIBLE_DEVICES", "0,1"),)
    assert [(d.id, d.library, d.name, d.max_tensor) for d in soft.gpus] == [
        ("vulkan:0", "vulkan", "NVIDIA GeForce RTX 4090", HARDWARE_MAX_TENSOR),
        ("vulkan:1", "vulkan", "llvmpipe (LLVM 15.0.6, 256 bits)", SOFTWARE_MAX_TENSOR),
    ]
    # the estimate, made before a device is chosen, assumes the strictest limit
    assert soft.max_tensor == SOFTWARE_MAX_TENSOR and plain.max_tensor == HARDWARE_MAX_TENSOR == 4 * GiB - 1
    assert discover(None).max_tensor == 0  # CPU only: no limit
    # capacity is what was free when listed: trioshed accounts the rest from its reservations
    assert soft.gpus[0].total == soft.gpus[0].free == 23000 * MiB
    assert soft.poll() == soft.gpus and not soft.recovers_vram


def test_a_users_own_visible_devices_are_kept_and_software_ones_still_dropped(fake_binary: str, no_nvml: None) -> None:
    listing = list_runner_devices(fake_binary, {"GGML_VK_VISIBLE_DEVICES": "1"})
    assert listing.vulkan == () and listing.env == ()
    source = discover(binary=fake_binary, env={"GGML_VK_VISIBLE_DEVICES": "1"})
    assert source.kind == "cpu"


def test_no_runner_binary_or_no_device_leaves_the_old_order(tmp_path: Path, no_nvml: None) -> None:
    declared = (Device("cuda:0", "cuda", 0, 8 * GiB, 8 * GiB),)
    assert discover(declared, binary=str(tmp_path / "missing"), env={}).kind == "declared"
    assert discover(None).kind == "cpu"


def test_an_nvml_card_is_counted_once_and_launched_as_its_vulkan_twin(
    fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    card = Device("cuda:0", "cuda", 0, 24564 * MiB, 20000 * MiB, name="NVIDIA GeForce RTX 4090")
    handle = object()
    monkeypatch.setattr(devices_module, "_nvml", lambda: DeviceSource((card,), "nvml", _handles=(handle,)))
    source = discover(binary=fake_binary, env={}, vulkan_software=True)
    assert source.kind == "nvml+vulkan"
    # the card once, polled by NVML, named as the Vulkan-only build knows it; lavapipe beside it
    assert [(d.id, d.free, d.max_tensor) for d in source.gpus] == [
        ("vulkan:0", 20000 * MiB, HARDWARE_MAX_TENSOR),  # a Vulkan device's limit: llama.cpp's Vulkan backend runs it
        ("vulkan:1", 2048 * MiB, SOFTWARE_MAX_TENSOR),
    ]
    assert source._handles == (handle, None) and source.recovers_vram


def test_same_card_needs_the_name_and_a_close_size() -> None:
    (amd, lvp, _) = parse_devices(LISTING)
    assert same_card("AMD Radeon RX 7900 XTX", 24 * GiB, amd)
    assert not same_card("AMD Radeon RX 7900 XTX", 12 * GiB, amd)
    assert not same_card("NVIDIA GeForce RTX 4090", 24 * GiB, amd)
    assert not same_card("", 2 * GiB, lvp)


# Placement with GPU-side compute terms -------------------------------------------------------


def test_full_offload_puts_the_host_compute_in_system_memory(tiny_models: dict[str, Path]) -> None:
    est = estimate(read_metadata(tiny_models["tiny-gqa"]), RunnerOptions(num_ctx=2048))
    assert est.gpu_compute_full is not None and est.host_compute_full is not None
    gpu = Device("vulkan:0", "vulkan", 0, 2 * GiB, 2 * GiB)
    p = place(est, [gpu], system_free=8 * GiB)
    assert isinstance(p, Placement) and p.n_gpu_layers == len(est.layers) + 1
    assert p.vram == (("vulkan:0", est.weights + est.kv + est.output + est.gpu_compute_full),)
    assert p.ram == est.token_embd + est.host_compute_full
    partial = place(est, [gpu], system_free=8 * GiB, num_gpu=2)
    assert isinstance(partial, Placement) and partial.n_gpu_layers == 2
    on_cpu = len(est.layers) - 1
    assert partial.ram == est.token_embd + sum(est.layers[:on_cpu]) + est.host_compute(full=False)


def test_an_output_tensor_too_big_for_the_device_stays_on_the_host() -> None:
    """gemma3 on lavapipe: the tied 170 MiB output weight stays the mapped CPU copy."""
    est = MemoryEstimate(weights=60 * MiB, kv=0, output=171 * MiB, token_embd=170 * MiB, compute_full=0,
                         compute_partial=0, layers=(30 * MiB, 30 * MiB), output_shared=170 * MiB,
                         output_tensor=170 * MiB)  # fmt: skip
    lavapipe = Device("vulkan:0", "vulkan", 0, 2 * GiB, 2 * GiB, max_tensor=128 * MiB)
    card = Device("vulkan:0", "vulkan", 0, 2 * GiB, 2 * GiB)
    on_lavapipe = place(est, [lavapipe], system_free=8 * GiB)
    on_card = place(est, [card], system_free=8 * GiB)
    assert on_lavapipe.vram == (("vulkan:0", 61 * MiB),) and on_lavapipe.ram == 170 * MiB
    assert on_card.vram == (("vulkan:0", 231 * MiB),) and on_card.ram == 170 * MiB
    untied = MemoryEstimate(weights=60 * MiB, kv=0, output=171 * MiB, token_embd=170 * MiB, compute_full=0,
                            compute_partial=0, layers=(30 * MiB, 30 * MiB), output_tensor=170 * MiB)  # fmt: skip
    p = place(untied, [lavapipe], system_free=8 * GiB)
    assert p.vram == (("vulkan:0", 61 * MiB),) and p.ram == 340 * MiB  # output.weight mapped on the CPU
