"""The memory estimate against what llama-server itself allocates (its ``-v`` buffer reports).

Each case starts a real ``llama-server`` on the CPU (``-ngl 0 -t 1``), waits for ``/health``,
stops and reaps it, and compares its reported buffers with ``estimate()``:

- weights (all model buffers) and KV cache within 3 %;
- the estimated total never more than 5 % under llama.cpp's total (model + KV + compute + output).

On the CPU, llama.cpp's weights are every tensor once, so the estimate's share is
``weights + token_embd + output - output_shared`` (tied output shares token_embd there).
The table of every case is printed and written to ``bench/results/estimate-vs-llamacpp.md``.

The Vulkan cases load every layer on a Vulkan device (lavapipe in CI; ``-ngl 99 --device Vulkan0
--no-warmup``: the buffers are reserved and reported before the warm-up run, so no shader is
compiled) and compare each buffer with the GPU terms of the estimate for the device's largest
tensor (``Device.max_tensor``: on lavapipe, 128 MiB, the attention of long contexts runs on the
CPU and its buffers are in system memory): the device's model and KV
buffers within 3 %, its compute buffer and the host compute buffer (``Vulkan_Host compute`` plus
the logits output buffer) -5 %/+10 % (or 2 MiB), as the CPU totals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.support.paths import REPO
from trioshed.core.estimate import estimate
from trioshed.core.estimate_compute import attention_on_host
from trioshed.core.estimate_kv import batch_sizes, effective_kv_type, kv_cells, swa_layers
from trioshed.core.model import Device, GiB, MiB, RunnerOptions
from trioshed.models.gguf_meta import GGUFMetadata, read_metadata
from trioshed.runner.binary import LlamaBinary, describe_build
from trioshed.runner.command import embedding_flags
from trioshed.testing.llama import LoadReport, llama_server_binary, measure_load
from trioshed.testing.tiny import write_tiny_model

RESULTS = REPO / "bench" / "results" / "estimate-vs-llamacpp.md"


@dataclass(frozen=True)
class Setting:
    num_ctx: int
    num_parallel: int
    kv: str
    fa: bool
    #: An embedding or rerank runner: its micro-batch is the whole context (``batch_sizes``).
    embedding: bool = False
    #: TRIOSHED_BATCH_INVARIANT: no repacked copy of the weights (``--no-repack``).
    batch_invariant: bool = False

    @property
    def id(self) -> str:
        embd = "-embd" if self.embedding else ""
        invariant = "-norepack" if self.batch_invariant else ""
        return f"ctx{self.num_ctx}-np{self.num_parallel}-{self.kv}-fa{'on' if self.fa else 'off'}{embd}{invariant}"

    def options(self) -> RunnerOptions:
        return RunnerOptions(
            num_ctx=self.num_ctx,
            num_parallel=self.num_parallel,
            kv_cache_type=self.kv,
            flash_attention=self.fa,
            num_thread=1,
            embedding=self.embedding,
            batch_invariant=self.batch_invariant,
        )

    def args(self, meta: GGUFMetadata) -> list[str]:
        """llama-server flags as trioshed's runner passes them (context = num_ctx x slots)."""
        opts = self.options()
        kv = effective_kv_type(opts, meta)
        return [
            "--fit", "off", "-ngl", "0", "-t", "1", "--device", "none",
            "-c", str(opts.kv_cells), "-np", str(opts.num_parallel),
            "-fa", "on" if self.fa else "off",
            "--cache-type-k", kv, "--cache-type-v", kv,
            "--batch-size", str(batch_sizes(opts)[0]), *embedding_flags(opts, meta),
            *(["--no-repack"] if self.batch_invariant else []),
        ]  # fmt: skip


ALL_SETTINGS = [
    Setting(ctx, np_, kv, fa)
    for ctx in (2048, 8192)
    for np_ in (1, 4)
    for kv, fa in (("f16", False), ("f16", True), ("q8_0", True), ("q4_0", True))
]
SOME_SETTINGS = [
    Setting(2048, 1, "f16", False),
    Setting(8192, 4, "f16", False),
    Setting(8192, 1, "q8_0", True),
    Setting(2048, 4, "q4_0", True),
]
TINY_CASES = [("tiny-gqa", s) for s in ALL_SETTINGS] + [
    (name, s) for name in ("tiny", "tiny-deep-f16", "tiny-q8-tied") for s in SOME_SETTINGS
]
GEMMA_SETTINGS = [
    Setting(2048, 1, "f16", False),
    Setting(8192, 4, "q8_0", True),
    Setting(8192, 1, "f16", True),
    # the automatic context's buckets, up to the trained 32768
    Setting(4096, 1, "f16", False),
    Setting(16384, 1, "f16", False),
    Setting(32768, 1, "f16", False),
    Setting(32768, 1, "f16", True),
    # batch-invariant runners: flash attention, and no repacked copy of the Q4_K weights
    Setting(4096, 1, "f16", True, batch_invariant=True),
]

VULKAN_HEADING = "# Memory estimate vs llama.cpp (Vulkan, every layer on `Vulkan0`)"
ROWS: list[str] = []
VULKAN_ROWS: list[str] = []
BUILDS: set[str] = set()
VULKAN_DEVICES: set[str] = set()
VULKAN_SETTINGS = [
    Setting(2048, 1, "f16", False),
    Setting(2048, 1, "f16", True),
    Setting(2048, 1, "q8_0", True),
    Setting(2048, 1, "q4_0", True),
    Setting(8192, 4, "f16", False),
    Setting(8192, 4, "q8_0", True),
]
VULKAN_CASES = [(name, s) for name in ("tiny-gqa", "tiny-q8-tied") for s in VULKAN_SETTINGS]
# Embedding and rerank runners: one micro-batch of the whole context (the CLS-pooled and the
# rank-pooled tiny models of ``embedding_models``), the compute buffer growing with its square.
EMBEDDING_SETTINGS = [
    Setting(4096, 1, "f16", False, embedding=True),
    Setting(4096, 1, "f16", True, embedding=True),
    Setting(2048, 4, "q8_0", True, embedding=True),
    Setting(512, 2, "f16", False, embedding=True),
]
EMBEDDING_CASES = [(name, s) for name in ("tiny-cls", "tiny-rank") for s in EMBEDDING_SETTINGS]
# Without flash attention lavapipe runs the 4,096 x 4,096 score matrix (above its largest
# buffer) on the CPU: counted on the host (``attention_on_host``).
VULKAN_EMBEDDING_CASES = [
    ("tiny-cls", EMBEDDING_SETTINGS[0]),
    ("tiny-cls", EMBEDDING_SETTINGS[1]),
    ("tiny-rank", EMBEDDING_SETTINGS[2]),
]
# Each flash-attention cache type makes lavapipe compile gemma3's 256-wide attention shaders
# anew (1.5-2.5 min each on this loaded 2-core machine): f16 and q8_0 only, the tiny models cover
# the rest. The automatic context's buckets up to the trained 32,768, with flash attention off and
# on: without it, the 256 MiB of scores at 32,768 cells exceed lavapipe's 128 MiB and that
# attention runs on the CPU (``attention_on_host``); 128 MiB at 16,384 stay on the device.
GEMMA_VULKAN_SETTINGS = [
    Setting(2048, 1, "f16", False),
    Setting(8192, 4, "q8_0", True),
    *(Setting(ctx, 1, "f16", fa) for ctx in (8192, 16384, 32768) for fa in (False, True)),
    # Beyond the trained context (llama-server runs it; trioshed would lower num_ctx): 512 MiB of
    # scores, and with flash attention a 256 MiB f16 mask, send that attention to the CPU too.
    Setting(65536, 1, "f16", False),
    Setting(262144, 1, "f16", True),
]


@pytest.fixture(scope="module", autouse=True)
def report_table():
    """Write the comparison table once every case of the module has run."""
    yield
    if not ROWS and not VULKAN_ROWS:
        return
    header = (
        "| case | weights est / real MiB | KV est / real MiB | compute est / real MiB "
        "| total est / real MiB | total error |\n|---|---|---|---|---|---|\n"
    )
    old = RESULTS.read_text() if RESULTS.exists() else ""
    cpu_part, marker, vulkan_part = old.partition(VULKAN_HEADING)
    if ROWS:  # a run of only some cases keeps the other table as it was
        cpu_part = (
            "# Memory estimate vs llama.cpp (CPU, `-ngl 0`)\n\n"
            "Generated by `tests/core/test_estimate.py`; real = llama-server's `-v` buffer reports "
            "(compute includes the logits output buffer). llama-server: "
            + ", ".join(sorted(BUILDS))
            + ".\n\n"
            + header
            + "\n".join(ROWS)
            + "\n\n"
        )
    if VULKAN_ROWS:
        marker = VULKAN_HEADING
        vulkan_part = (
            "\n\nGenerated by `tests/core/test_estimate.py` (`-ngl 99 --device Vulkan0 --no-warmup`) on "
            + ", ".join(sorted(VULKAN_DEVICES))
            + ". model and KV: the device's buffers; device compute: `Vulkan0 compute`; host "
            "compute: `Vulkan_Host compute` + the logits output buffer (system memory). Host total "
            "adds the input layer kept on the CPU (`CPU_Mapped`).\n\n"
            "| case | model est / real MiB | KV est / real MiB | device compute est / real MiB "
            "| host compute est / real MiB | device total error | host total error |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(VULKAN_ROWS) + "\n"
        )
    text = (cpu_part.rstrip("\n") + "\n\n" if marker else cpu_part) + marker + vulkan_part
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print("\n" + text)


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def check(name: str, model: Path, setting: Setting) -> None:
    meta = read_metadata(model)
    try:
        report: LoadReport = measure_load(model, setting.args(meta), timeout=120)
    except RuntimeError as e:
        if "code -4" in str(e) or "Illegal instruction" in str(e):
            pytest.skip(
                f"this llama-server cannot run on this CPU (SIGILL); set TRIOSHED_LLAMA_SERVER: {e}"
            )
        raise
    version = re.search(r"build[:=]? ?(\d+) \((\w+)\)", report.log)
    binary = LlamaBinary(report.argv[0], {})
    BUILDS.add(describe_build(binary, f"version: {version[1]} ({version[2]})" if version else ""))
    real = report.memory
    assert real is not None, f"no buffer sizes in the log of {report.argv}"
    est = estimate(meta, setting.options())
    est_weights = est.weights + est.token_embd + est.output - est.output_shared + est.cpu_repack
    real_compute = sum(real.compute.values()) + sum(real.output.values())
    est_total = est.cpu_total
    real_total = real.total
    error = (est_total - real_total) / real_total
    case = f"{name} {setting.id}"
    row = (
        f"| {case} | {_mib(est_weights)} / {_mib(real.weights)} | {_mib(est.kv)} / {_mib(real.kv)} "
        f"| {_mib(est.compute_full)} / {_mib(real_compute)} | {_mib(est_total)} / {_mib(real_total)} "
        f"| {error * 100:+.1f} % |"
    )
    ROWS.append(row)
    detail = f"{case}: est {est}; llama.cpp {real}\n{row}"
    assert est_weights == pytest.approx(real.weights, rel=0.03), detail
    assert est.kv == pytest.approx(real.kv, rel=0.03, abs=64 * 1024), detail
    assert est_total >= 0.95 * real_total, detail
    # Over is safe but wastes room: at most 10 % or 2 MiB (compute buffers of tiny models differ
    # by ~0.5 MiB between builds b10068 and b11434).
    assert est_total <= max(1.10 * real_total, real_total + 2 * MiB), detail


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "setting"), TINY_CASES, ids=[f"{n}-{s.id}" for n, s in TINY_CASES]
)
def test_estimate_matches_llama_cpp_tiny(name: str, setting: Setting, tiny_models) -> None:
    check(name, tiny_models[name], setting)


@pytest.fixture(scope="module")
def embedding_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny 4,096-context models that set their pooling: CLS (an embedding model) and rank (a
    reranker, started with ``--rerank``)."""
    folder = tmp_path_factory.mktemp("tiny-embedding")
    return {
        "tiny-cls": write_tiny_model(folder / "cls.gguf", pooling_type=2, context_length=4096),
        "tiny-rank": write_tiny_model(folder / "rank.gguf", pooling_type=4, context_length=4096),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("name", "setting"), EMBEDDING_CASES, ids=[f"{n}-{s.id}" for n, s in EMBEDDING_CASES])
def test_estimate_matches_llama_cpp_embedding(name: str, setting: Setting, embedding_models) -> None:
    check(name, embedding_models[name], setting)


@pytest.mark.slow
@pytest.mark.parametrize("setting", GEMMA_SETTINGS, ids=lambda s: s.id)
def test_estimate_matches_llama_cpp_gemma3(setting: Setting, gemma_model) -> None:
    check("gemma3-270m", gemma_model, setting)


def _within(est: int, real: int) -> bool:
    """The CPU total's bounds: never more than 5 % under, at most 10 % (or 2 MiB) over."""
    return 0.95 * real <= est <= max(1.10 * real, real + 2 * MiB)


def check_vulkan(name: str, model: Path, setting: Setting, device: Device, env: dict[str, str]) -> None:
    meta = read_metadata(model)
    args = [a if a != "none" else "Vulkan0" for a in setting.args(meta)]
    args[args.index("-ngl") + 1] = "99"
    report = measure_load(model, [*args, "--no-warmup"], timeout=240, binary=(llama_server_binary()[0], env))
    real = report.memory
    assert real is not None, f"no buffer sizes in the log of {report.argv}"
    VULKAN_DEVICES.add(f"`{device.name}`")
    est = estimate(meta, setting.options(), max_tensor=device.max_tensor)
    big_output = bool(device.max_tensor) and est.output_tensor > device.max_tensor
    est_model = est.weights + est.output - (est.output_tensor if big_output else 0)
    est_gpu_compute = est.gpu_compute(full=True)
    est_host_compute = est.host_compute(full=True)
    est_gpu = est_model + est.kv + est_gpu_compute
    est_host = est.token_embd + est_host_compute
    by_backend = real.by_backend()
    real_model = real.model.get("Vulkan0", 0)
    real_kv = real.kv_buffers.get("Vulkan0", 0)
    real_gpu_compute = real.compute.get("Vulkan0", 0)
    real_host_compute = real.compute.get("Vulkan_Host", 0) + sum(real.output.values())
    real_gpu = by_backend.get("Vulkan0", 0)
    real_host = sum(b for backend, b in by_backend.items() if backend != "Vulkan0")
    row = (
        f"| {name} {setting.id} | {_mib(est_model)} / {_mib(real_model)} | {_mib(est.kv)} / {_mib(real_kv)} "
        f"| {_mib(est_gpu_compute)} / {_mib(real_gpu_compute)} | {_mib(est_host_compute)} / {_mib(real_host_compute)} "
        f"| {(est_gpu - real_gpu) / real_gpu * 100:+.1f} % | {(est_host - real_host) / real_host * 100:+.1f} % |"
    )
    VULKAN_ROWS.append(row)
    detail = f"{name} {setting.id}: est {est}; llama.cpp {by_backend}\n{row}"
    assert real.kv_buffers.keys() == {"Vulkan0"}, detail  # every layer's cache on the device
    assert est_model == pytest.approx(real_model, rel=0.03, abs=64 * 1024), detail
    assert est.kv == pytest.approx(real_kv, rel=0.03, abs=64 * 1024), detail
    assert _within(est_gpu_compute, real_gpu_compute), detail
    assert _within(est_host_compute, real_host_compute), detail
    assert _within(est_gpu, real_gpu) and _within(est_host, real_host), detail


@pytest.mark.slow
@pytest.mark.parametrize(("name", "setting"), VULKAN_CASES, ids=[f"{n}-{s.id}" for n, s in VULKAN_CASES])
def test_estimate_matches_llama_cpp_vulkan_tiny(
    name: str, setting: Setting, tiny_models, vulkan_device: tuple[Device, dict[str, str]]
) -> None:
    check_vulkan(name, tiny_models[name], setting, *vulkan_device)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "setting"), VULKAN_EMBEDDING_CASES, ids=[f"{n}-{s.id}" for n, s in VULKAN_EMBEDDING_CASES]
)
def test_estimate_matches_llama_cpp_vulkan_embedding(
    name: str, setting: Setting, embedding_models, vulkan_device: tuple[Device, dict[str, str]]
) -> None:
    check_vulkan(name, embedding_models[name], setting, *vulkan_device)


@pytest.mark.slow
@pytest.mark.parametrize("setting", GEMMA_VULKAN_SETTINGS, ids=lambda s: s.id)
def test_estimate_matches_llama_cpp_vulkan_gemma3(
    setting: Setting, gemma_model, vulkan_device: tuple[Device, dict[str, str]]
) -> None:
    check_vulkan("gemma3-270m", gemma_model, setting, *vulkan_device)


FORCED_LIMIT = 100 * MiB  # under lavapipe's 128 MiB, over gemma3's 65 MiB model buffer


@pytest.mark.slow
def test_estimate_matches_llama_cpp_vulkan_gemma3_under_a_lower_limit(
    gemma_model, vulkan_device: tuple[Device, dict[str, str]]
) -> None:
    """The device's limit is what decides: ``GGML_VK_FORCE_MAX_BUFFER_SIZE`` lowers llama.cpp's
    Vulkan limit to 100 MiB, and the 128 MiB of scores at 16,384 cells, which lavapipe takes, run
    on the CPU too; the estimate with ``max_tensor`` 100 MiB says so."""
    device, env = vulkan_device
    forced = replace(device, max_tensor=FORCED_LIMIT)
    env = {**env, "GGML_VK_FORCE_MAX_BUFFER_SIZE": str(FORCED_LIMIT)}
    check_vulkan("gemma3-270m-max100MiB", gemma_model, Setting(16384, 1, "f16", False), forced, env)


# Pure checks (no process) -------------------------------------------------------------------


def test_gemma3_swa_layers_and_cells(gemma_model) -> None:
    meta = read_metadata(gemma_model)
    flags = swa_layers(meta)
    assert [il for il, swa in enumerate(flags) if not swa] == [5, 11, 17]  # every 6th is global
    opts = RunnerOptions(num_ctx=8192, num_parallel=4)
    cells = kv_cells(meta, opts)
    assert cells[5] == 8192 * 4  # full cache: num_ctx per slot
    assert cells[0] == 1024 * 4  # window 512 + ubatch 512, per slot
    small = kv_cells(meta, RunnerOptions(num_ctx=300, num_parallel=1))
    assert small[5] == 512 and small[0] == 512  # padded to 256, window capped by the context


def test_attention_too_big_for_the_device_is_counted_on_the_host(gemma_model) -> None:
    """gemma3-270m on lavapipe (128 MiB): without flash attention the full cache's scores are
    4 heads x 512 tokens x n_kv x 4 bytes; at 32,768 cells (256 MiB) llama.cpp runs that attention
    on the CPU, at 16,384 (exactly 128 MiB) it stays on the device."""
    meta = read_metadata(gemma_model)
    lavapipe = 128 * MiB
    off = RunnerOptions(num_ctx=32768)
    on = RunnerOptions(num_ctx=32768, flash_attention=True)
    assert attention_on_host(meta, off, lavapipe) == (32768,)  # the window's 1,024 cells stay
    assert attention_on_host(meta, RunnerOptions(num_ctx=16384), lavapipe) == ()
    assert attention_on_host(meta, on, lavapipe) == ()  # no scores; the f16 mask is 32 MiB
    assert attention_on_host(meta, off, 0) == attention_on_host(meta, off, 4 * GiB - 1) == ()
    free, bound = estimate(meta, off), estimate(meta, off, max_tensor=lavapipe)
    assert bound.compute_full == free.compute_full and bound.kv == free.kv  # the CPU's own figures
    # host: the scores, the copies of the layer's K and V views (f16, 256 wide) and of Q (f32)
    moved = 32768 * 512 * 4 * 4 + 2 * 32768 * 256 * 2 + 512 * 1024 * 4
    assert bound.host_compute(full=True) - free.host_compute(full=True) == moved
    assert bound.host_compute(full=False) - free.host_compute(full=False) == moved
    # device: neither those scores nor the full cache's mask (the window's 2 MiB one stays)
    full_mask = 32768 * 512 * 4
    assert free.gpu_compute(full=True) - bound.gpu_compute(full=True) > 32768 * 512 * 4 * 4 + full_mask - 16 * MiB
    assert bound.gpu_compute(full=True) < 24 * MiB  # llama.cpp: 19.51 MiB
    # the estimate of a draft model sees the same device
    draft = estimate(meta, off, draft=meta, max_tensor=lavapipe).draft
    assert draft is not None and draft.host_compute(full=True) == bound.host_compute(full=True)


def test_layers_and_tied_output(tiny_models) -> None:
    meta = read_metadata(tiny_models["tiny-q8-tied"])
    opts = RunnerOptions(num_ctx=2048)
    est = estimate(meta, opts)
    assert len(est.layers) == meta.block_count
    assert sum(est.layers) == est.weights + est.kv
    assert est.token_embd == meta.tensor_map["token_embd.weight"].nbytes
    assert est.output_shared == est.token_embd  # no output.weight: token_embd is reused
    assert est.cpu_total == est.total - est.output_shared + est.cpu_repack
    untied = estimate(read_metadata(tiny_models["tiny"]), opts)
    assert untied.output_shared == 0
    assert untied.output > read_metadata(tiny_models["tiny"]).tensor_map["output.weight"].nbytes


def test_quantized_cache_needs_flash_attention_and_a_divisible_head(tiny_models) -> None:
    gqa = read_metadata(tiny_models["tiny-gqa"])  # head width 32
    narrow = read_metadata(tiny_models["tiny"])  # head width 16
    assert (
        effective_kv_type(RunnerOptions(kv_cache_type="q8_0", flash_attention=True), gqa) == "q8_0"
    )
    assert (
        effective_kv_type(RunnerOptions(kv_cache_type="q8_0", flash_attention=False), gqa) == "f16"
    )
    assert (
        effective_kv_type(RunnerOptions(kv_cache_type="q4_0", flash_attention=True), narrow)
        == "f16"
    )
    f16 = estimate(gqa, RunnerOptions(flash_attention=True))
    q8 = estimate(gqa, RunnerOptions(kv_cache_type="q8_0", flash_attention=True))
    q4 = estimate(gqa, RunnerOptions(kv_cache_type="q4_0", flash_attention=True))
    assert q8.kv == f16.kv * 34 // 64  # 34 bytes per 32 elements vs 64
    assert q4.kv == f16.kv * 18 // 64
    with pytest.raises(ValueError, match="unknown KV cache type"):
        estimate(gqa, RunnerOptions(kv_cache_type="q3"))


def test_kv_scales_with_context_and_slots(tiny_models) -> None:
    meta = read_metadata(tiny_models["tiny"])
    one = estimate(meta, RunnerOptions(num_ctx=2048, num_parallel=1))
    four = estimate(meta, RunnerOptions(num_ctx=2048, num_parallel=4))
    assert four.kv == 4 * one.kv
    assert four.compute_full >= one.compute_full
    no_fa = estimate(meta, RunnerOptions(num_ctx=8192))
    fa = estimate(meta, RunnerOptions(num_ctx=8192, flash_attention=True))
    assert fa.compute_full < no_fa.compute_full  # no score matrix with flash attention
    assert one.projector == 0
    assert estimate(meta, RunnerOptions(), projector_bytes=5, adapter_bytes=7).total == (
        estimate(meta, RunnerOptions()).total + 12
    )
