"""Placement on a real Vulkan device (lavapipe in CI), end to end through trioshed.

trioshed discovers ``Vulkan0`` from ``llama-server --list-devices`` (TRIOSHED_VULKAN_SOFTWARE=1),
plans where each layer goes, and starts the runner with ``--device Vulkan0 -ngl N``. These tests
check that llama.cpp did what was planned: the layers it reports offloading ("offloaded N/M
layers") are the planned ``n_gpu_layers``, and the buffers it reports per device (``Vulkan0
model/KV/compute``, and the host's ``CPU_Mapped``, ``CPU KV``, ``Vulkan_Host compute``) are the
planned ones (weights and KV within 3 %, each device's total -5 %/+10 % or 2 MiB, the CPU bounds
of ``tests/core/test_estimate.py``); ``/api/ps`` ``size_vram`` is the GPU share llama.cpp reported.

Whole model, partial offload (asked for with ``num_gpu``, and chosen by trioshed when the device
has too little room) and CPU fallback (no room at all), with a tiny model and with gemma3-270m.
They skip, saying why, without a Vulkan device.

Time on lavapipe is shader compilation: a graph's first run compiles its shaders (measured on
this 2-core machine under load: ~2 min for the tiny model's whole-offload graph, ~1.5 min more
for partial offload's; ~4 s once Mesa's cache, shared by the session, holds them). So one
request generates (the tiny model, whole on Vulkan0: it answers), and the other loads are
load-only requests (empty prompt) of models run with ``--no-warmup`` (``models.toml`` args):
llama.cpp reserves and reports every buffer before its warm-up run, and nothing is compiled.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.core.estimate import estimate
from trioshed.core.estimate_kv import effective_kv_type, kv_layer_bytes
from trioshed.core.model import Device, MemoryEstimate, MiB, RunnerOptions
from trioshed.models.gguf_meta import read_metadata
from trioshed.scheduler import RunnerStats
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

CTX = 2048
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def _log_lines(caplog: pytest.LogCaptureFixture, pid: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trioshed.runner.output" and f"[{pid}] " in r.getMessage()]


def _offloaded(caplog: pytest.LogCaptureFixture, pid: int) -> tuple[int, int]:
    found = [m for line in _log_lines(caplog, pid) if (m := _OFFLOADED.search(line))]
    assert found, "llama-server did not report its offloaded layers"
    return int(found[-1][1]), int(found[-1][2])


def _near(planned: int, real: int) -> bool:
    """The CPU table's bounds for a device's total: -5 %, +10 % or 2 MiB."""
    return 0.95 * real <= planned <= max(1.10 * real, real + 2 * MiB)


def check_against_plan(runner: RunnerStats, model: Path, device: Device, size_vram: int) -> dict[str, int]:
    """Compare llama.cpp's buffers with the plan; returns the buffers per backend (for messages)."""
    placement, est, measured = runner.placement, runner.estimate, runner.measured
    assert placement is not None and isinstance(est, MemoryEstimate) and measured is not None
    opts = runner.options
    meta = read_metadata(model)
    kv = kv_layer_bytes(meta, opts)
    weights = [b - k for b, k in zip(est.layers, kv, strict=True)]
    n_layer, ngl = len(est.layers), placement.n_gpu_layers
    on_cpu = max(n_layer + 1 - ngl, 0) if ngl else n_layer
    by_backend = measured.by_backend()
    detail = f"plan {placement}; llama.cpp {by_backend}"
    gpu = measured.model.get("Vulkan0", 0)
    gpu_kv = measured.kv_buffers.get("Vulkan0", 0)
    if ngl == 0:
        assert placement.devices == () and gpu == gpu_kv == 0, detail
        assert size_vram == 0
        return by_backend
    output = est.output - (est.output_tensor if device.max_tensor and est.output_tensor > device.max_tensor else 0)
    assert gpu == pytest.approx(sum(weights[on_cpu:]) + output, rel=0.03, abs=64 * 1024), detail
    assert gpu_kv == pytest.approx(sum(kv[on_cpu:]), rel=0.03, abs=64 * 1024), detail
    assert measured.kv_buffers.get("CPU", 0) == pytest.approx(sum(kv[:on_cpu]), rel=0.03, abs=64 * 1024), detail
    real_gpu = sum(b for name, b in by_backend.items() if name == "Vulkan0")
    real_host = sum(b for name, b in by_backend.items() if name != "Vulkan0")
    assert dict(placement.vram).keys() == {device.id}, detail
    assert _near(placement.vram_total, real_gpu), detail
    assert _near(placement.ram - est.prompt_cache, real_host), detail  # the prompt cache: no buffer
    assert size_vram == real_gpu  # /api/ps shows what llama.cpp put on the GPU
    return by_backend


async def _load(http: httpx.AsyncClient, model: str, *, prompt: str = "", **options: object) -> int:
    """Load ``model`` (and generate 2 tokens when ``prompt``); its ``/api/ps`` ``size_vram``."""
    body = {"model": model, "prompt": prompt, "stream": False, "options": {"num_predict": 2, "num_ctx": CTX, **options}}
    response = await http.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    if prompt:
        assert response.json()["eval_count"] >= 1, response.json()
    (ps,) = (await http.get("/api/ps")).json()["models"]
    return int(ps["size_vram"])


def _store(tmp_path: Path, name: str, model: Path | None = None) -> tuple[Path, Path]:
    """A store whose ``name`` runs with ``--no-warmup`` (a tiny GQA model unless ``model``)."""
    store = tmp_path / "models"
    store.mkdir()
    if model is None:
        model = add_tiny(store, "gqa-file", n_embd=128, n_layer=4, n_head=4, n_head_kv=2)
    (store / "models.toml").write_text(f'[models."{name}"]\npath = {json.dumps(str(model))}\nargs = ["--no-warmup"]\n')
    return store, model


async def test_tiny_model_whole_partial_and_on_the_cpu(
    tmp_path: Path, vulkan_device: tuple[Device, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    device, _ = vulkan_device
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    store, path = _store(tmp_path, "gqa")
    with trio.fail_after(300):
        async with (
            open_test_server(store, vulkan_software=True) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=200) as http,
        ):
            assert [d.id for d in server.devices.gpus] == [device.id]
            for num_gpu, layers, where in ((-1, 5, "Vulkan0"), (2, 2, "Vulkan0"), (0, 0, "none")):
                options = {} if num_gpu < 0 else {"num_gpu": num_gpu}
                size_vram = await _load(http, "gqa", prompt="hi" if layers == 5 else "", **options)
                (runner,) = server.scheduler.statistics().runners
                assert runner.pid is not None and runner.placement is not None
                argv = psutil.Process(runner.pid).cmdline()
                assert argv[argv.index("--device") + 1] == where
                assert runner.placement.n_gpu_layers == layers
                assert _offloaded(caplog, runner.pid) == (layers, 5)
                check_against_plan(runner, path, device, size_vram)


async def test_trioshed_offloads_what_fits_and_falls_back_to_the_cpu(
    tmp_path: Path, vulkan_device: tuple[Device, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Too little room on Vulkan0 (TRIOSHED_GPU_OVERHEAD): the layers that fit, then none."""
    device, _ = vulkan_device
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    store, path = _store(tmp_path, "gqa")
    est = estimate(read_metadata(path), RunnerOptions(num_ctx=CTX, num_thread=1))
    room = est.gpu_compute(full=False) + est.output + est.layers[-1] + est.layers[-2] + MiB // 2  # 3 of 5
    for overhead, layers in ((device.free - room, 3), (device.free, 0)):
        with trio.fail_after(120):
            async with (
                open_test_server(store, vulkan_software=True, gpu_overhead=overhead) as server,
                httpx.AsyncClient(base_url=server.base_url, timeout=100) as http,
            ):
                size_vram = await _load(http, "gqa")
                (runner,) = server.scheduler.statistics().runners
                assert runner.pid is not None and runner.placement is not None
                assert runner.placement.n_gpu_layers == layers
                assert _offloaded(caplog, runner.pid) == (layers, 5)
                check_against_plan(runner, path, device, size_vram)


async def test_gemma3_whole_and_partial(
    tmp_path: Path,
    gemma_model: Path,
    vulkan_device: tuple[Device, dict[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gemma3-270m: 18 layers + output on Vulkan0, then 10 of 19. On lavapipe its tied 170 MiB
    output weight is bigger than the device takes (``Device.max_tensor``) and stays on the CPU."""
    device, _ = vulkan_device
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    store, _ = _store(tmp_path, "gemma3-270m", gemma_model)
    with trio.fail_after(240):
        async with (
            open_test_server(store, vulkan_software=True) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=200) as http,
        ):
            for options, layers in (({}, 19), ({"num_gpu": 10}, 10)):
                size_vram = await _load(http, "gemma3-270m", **options)
                (runner,) = server.scheduler.statistics().runners
                assert runner.pid is not None and runner.placement is not None
                assert runner.placement.n_gpu_layers == layers
                assert _offloaded(caplog, runner.pid) == (layers, 19)
                by_backend = check_against_plan(runner, gemma_model, device, size_vram)
                assert effective_kv_type(runner.options) == "f16"
                if layers == 19 and device.max_tensor:
                    assert by_backend["CPU_Mapped"] == pytest.approx(170 * MiB, rel=0.01)  # token_embd, once


async def test_gemma3_at_its_trained_context_computes_long_attention_on_the_host(
    tmp_path: Path,
    gemma_model: Path,
    vulkan_device: tuple[Device, dict[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gemma3-270m at 32,768 tokens without flash attention: each full-context layer's scores
    (256 MiB) are over lavapipe's largest tensor, so llama.cpp computes that attention on the CPU
    and its buffers are in system memory. The scheduler's estimate knows the device's limit, and
    the plan matches llama.cpp's buffers on both sides."""
    device, _ = vulkan_device
    if not device.max_tensor or device.max_tensor >= 256 * MiB:
        pytest.skip(f"{device.name} takes the 256 MiB scores: nothing moves to the host")
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    store, _ = _store(tmp_path, "gemma3-270m", gemma_model)
    with trio.fail_after(240):
        async with (
            open_test_server(store, vulkan_software=True) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=200) as http,
        ):
            size_vram = await _load(http, "gemma3-270m", num_ctx=32768)
            (runner,) = server.scheduler.statistics().runners
            assert runner.pid is not None and runner.placement is not None
            assert runner.options.num_ctx == 32768 and not runner.options.flash_attention
            assert _offloaded(caplog, runner.pid) == (19, 19)
            by_backend = check_against_plan(runner, gemma_model, device, size_vram)
            assert by_backend["Vulkan_Host"] > 256 * MiB  # the scores are in system memory
