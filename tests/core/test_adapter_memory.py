"""The estimate of LoRA adapters against llama-server's own "LoRA buffer size" lines: each
adapter's tensors on the device of the layer they adapt, within the existing estimate checks'
bounds (3 %, or 64 KiB for the lines' rounding to 0.01 MiB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioshed.core.adapter_memory import AdapterBytes, adapter_bytes, with_adapters
from trioshed.core.estimate import estimate
from trioshed.core.model import Device, RunnerOptions
from trioshed.models.gguf_meta import read_metadata
from trioshed.runner.memlog import parse_memory_log
from trioshed.testing.adapters import write_lora
from trioshed.testing.llama import llama_server_binary, running_llama_server
from trioshed.testing.tiny import write_tiny_model

N_LAYER = 3
#: No warm-up: the buffers are allocated at load (and lavapipe would compile its shaders first).
ARGS = ["-t", "1", "--fit", "off", "-c", "512", "-np", "1", "--no-warmup"]


def _within(est: int, real: int) -> bool:
    return abs(est - real) <= max(0.03 * real, 64 * 1024)


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[AdapterBytes]]:
    folder = tmp_path_factory.mktemp("lora-memory")
    model = write_tiny_model(folder / "m.gguf", n_embd=256, n_layer=N_LAYER, n_head=8, n_head_kv=4, weight_type="Q8_0", tied_embeddings=True)
    adapters = [write_lora(folder / "a.gguf", model, rank=32, seed=1), write_lora(folder / "b.gguf", model, rank=32, seed=2, targets=("attn_q",))]
    parts = [adapter_bytes(((t.name, t.nbytes) for t in read_metadata(str(a)).tensors), N_LAYER) for a in adapters]
    return model, adapters, parts


def test_adapters_in_system_memory(model_and_adapters: tuple[Path, list[Path], list[AdapterBytes]]) -> None:
    model, adapters, parts = model_and_adapters
    with running_llama_server(model, [*ARGS, "-ngl", "0", "--device", "none", "--lora", ",".join(map(str, adapters))], timeout=120) as server:
        pass
    measured = parse_memory_log(server.log_text())
    assert measured is not None and set(measured.adapters) == {"CPU_Mapped"}
    assert _within(sum(p.total for p in parts), measured.adapters["CPU_Mapped"])
    # and the estimate grows by them, on the layers they adapt
    est = estimate(read_metadata(str(model)), RunnerOptions(num_ctx=512))
    folded = with_adapters(est, parts)
    assert folded.total - est.total == sum(p.total for p in parts)
    assert [x - y for x, y in zip(folded.layers, est.layers, strict=True)] == [sum(p.layers[i] for p in parts) for i in range(N_LAYER)]


@pytest.mark.slow
@pytest.mark.parametrize("ngl", [2, 99])
def test_adapters_go_with_their_layers_to_the_gpu(
    model_and_adapters: tuple[Path, list[Path], list[AdapterBytes]], vulkan_device: tuple[Device, dict[str, str]], ngl: int
) -> None:
    """``-ngl 2`` offloads the output and the last repeating layer: that layer's adapter tensors
    go to the GPU with it, the others stay in system memory, as the estimate places them."""
    model, adapters, parts = model_and_adapters
    device, env = vulkan_device
    args = [*ARGS, "-ngl", str(ngl), "--device", "Vulkan0", "--lora", ",".join(map(str, adapters))]
    with running_llama_server(model, args, timeout=240, binary=(llama_server_binary()[0], env)) as server:
        pass
    measured = parse_memory_log(server.log_text())
    assert measured is not None
    offloaded = range(max(N_LAYER + 1 - ngl, 0), N_LAYER)
    on_gpu = sum(p.layers[i] for p in parts for i in offloaded) + sum(p.output for p in parts)
    on_host = sum(p.total for p in parts) - on_gpu
    assert _within(on_gpu, measured.adapters.get("Vulkan0", 0)), measured.adapters
    assert _within(on_host, measured.adapters.get("CPU_Mapped", 0)), measured.adapters
    assert device.library == "vulkan"
