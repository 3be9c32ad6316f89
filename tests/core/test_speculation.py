"""Speculative decoding without processes: settings, models.toml keys, flags, the draft model's
memory in the estimate and the placement, its buffers in the memory log, vocabularies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from trioshed.config import Settings
from trioshed.core.estimate import estimate
from trioshed.core.model import Device, GiB, MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.placement import place
from trioshed.core.speculation import (
    CHOICES,
    DEFAULT,
    drafted_accepted,
    parse_speculation,
)
from trioshed.models.catalogue import parse_catalogue
from trioshed.models.gguf_meta import read_metadata
from trioshed.models.vocab import incompatibility
from trioshed.runner.command import NGRAM, build_command, ngram_args
from trioshed.runner.memlog import parse_memory_log
from trioshed.testing.tiny import write_tiny_model

MODEL = ModelSpec("m:latest", "/m.gguf")


def test_speculation_values() -> None:
    assert parse_speculation("ngram") == "ngram" and parse_speculation(" NGRAM-MOD ") == "ngram-mod"
    assert parse_speculation(True) == "ngram" and parse_speculation(False) == "off"
    assert parse_speculation("on") == "ngram" and parse_speculation("false") == "off"
    for bad in ("draft-simple", "ngram-fast", 3, None):
        with pytest.raises(ValueError, match="use one of off, ngram"):
            parse_speculation(bad)
    assert DEFAULT in CHOICES
    assert ngram_args("off") == [] and ngram_args("ngram") == list(NGRAM)
    assert ngram_args("ngram-cache") == ["--spec-type", "ngram-cache"]


def test_the_setting_and_its_default() -> None:
    assert Settings().speculation == DEFAULT
    assert Settings.from_env({"TRIOSHED_SPECULATION": "off"}).speculation == "off"
    assert Settings.from_env({"TRIOSHED_SPECULATION": "ngram-map-k"}).speculation == "ngram-map-k"
    with pytest.raises(ValueError, match="TRIOSHED_SPECULATION='fast': use one of"):
        Settings.from_env({"TRIOSHED_SPECULATION": "fast"})


def test_the_default_and_what_ngram_means(tmp_path: Path) -> None:
    """Measured (docs/benchmarks.md): on by default, as "ngram", a 12-token lookup with drafts of
    up to 16 tokens. A model that says nothing runs with exactly those flags, one that says "off"
    without; a model that writes no text (an embedding model) has nothing to draft."""
    from trioshed.api.state import AppState
    from trioshed.models.stores import Stores

    assert DEFAULT == "ngram" and Settings().speculation == "ngram"
    assert NGRAM == ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12",
                     "--spec-ngram-simple-size-m", "16")  # fmt: skip
    write_tiny_model(tmp_path / "a.gguf")
    write_tiny_model(tmp_path / "e.gguf", pooling_type=1, chat_template="")
    (tmp_path / "models.toml").write_text(
        '[models.off]\npath = "a.gguf"\nspeculation = "off"\n\n[models.embed]\npath = "e.gguf"\nspeculation = "ngram"\n'
    )
    stores = Stores(tmp_path)
    state = AppState(settings=Settings(models=tmp_path), store=stores, scheduler=None)  # type: ignore[arg-type]

    def argv(name: str, settings: Settings | None = None) -> list[str]:
        state.settings = settings or Settings(models=tmp_path)
        return build_command("/bin/llama-server", MODEL, state.runner_options(stores.resolve(name), {}), Placement(0), port=1)

    on = argv("a")
    assert on[on.index("--spec-type") : on.index("--spec-type") + len(NGRAM)] == list(NGRAM)
    assert not any(a.startswith("--spec") for a in argv("off"))
    assert state.runner_options(stores.resolve("embed"), {}).speculation == "off"
    assert not any(a.startswith("--spec") for a in argv("embed"))
    everywhere_off = Settings.from_env({"TRIOSHED_MODELS": str(tmp_path), "TRIOSHED_SPECULATION": "off"})
    assert not any(a.startswith("--spec") for a in argv("a", everywhere_off))


def test_batch_invariant_runners(tmp_path: Path) -> None:
    """TRIOSHED_BATCH_INVARIANT: flash attention on and no repacked weights (whatever
    TRIOSHED_FLASH_ATTENTION says), and no repacked copy counted in the estimate."""
    from trioshed.api.state import AppState
    from trioshed.models.stores import Stores

    write_tiny_model(tmp_path / "a.gguf")
    stores = Stores(tmp_path)
    settings = Settings.from_env({"TRIOSHED_MODELS": str(tmp_path), "TRIOSHED_BATCH_INVARIANT": "true",
                                  "TRIOSHED_FLASH_ATTENTION": "false"})  # fmt: skip
    assert settings.batch_invariant and not Settings().batch_invariant
    state = AppState(settings=settings, store=stores, scheduler=None)  # type: ignore[arg-type]
    options = state.runner_options(stores.resolve("a"), {})
    assert options.batch_invariant and options.flash_attention
    cmd = build_command("/bin/llama-server", MODEL, options, Placement(0), port=1)
    assert "--no-repack" in cmd and cmd[cmd.index("--flash-attn") + 1] == "on"
    plain = build_command("/bin/llama-server", MODEL, replace(options, batch_invariant=False), Placement(0), port=1)
    assert "--no-repack" not in plain
    meta = read_metadata(write_tiny_model(tmp_path / "q.gguf", weight_type="Q8_0"))
    q4k = replace(meta, tensors=tuple(replace(t, ggml_type=12) if t.name == "blk.0.ffn_up.weight" else t
                                      for t in meta.tensors))  # fmt: skip
    repacked = estimate(q4k, RunnerOptions())
    assert repacked.cpu_repack > 0
    assert estimate(q4k, RunnerOptions(batch_invariant=True)).cpu_repack == 0
    with pytest.raises(ValueError, match="TRIOSHED_BATCH_INVARIANT"):
        Settings.from_env({"TRIOSHED_BATCH_INVARIANT": "sometimes"})


def test_flags_for_each_kind() -> None:
    def argv(options: RunnerOptions, placement: Placement | None = None, **kw: object) -> list[str]:
        return build_command("/bin/llama-server", MODEL, options, placement or Placement(0), port=1, **kw)  # type: ignore[arg-type]

    assert "--spec-type" not in argv(RunnerOptions())
    on = argv(RunnerOptions(speculation="ngram"))
    assert on[on.index("--spec-type") : on.index("--spec-type") + len(NGRAM)] == list(NGRAM)
    assert argv(RunnerOptions(speculation="ngram-mod")).count("ngram-mod") == 1
    # A draft model replaces n-gram drafting; on the CPU it stays in system memory.
    cpu = argv(RunnerOptions(speculation="ngram", draft="/d.gguf"))
    assert cpu[cpu.index("--model-draft") + 1] == "/d.gguf" and cpu[cpu.index("--spec-type") + 1] == "draft-simple"
    assert cpu.count("--spec-type") == 1
    assert cpu[cpu.index("--spec-draft-ngl") + 1] == "0" and cpu[cpu.index("--device-draft") + 1] == "none"
    # On a GPU with the target: all of its layers there; with a quantized cache, the same type.
    gpu = Placement(19, devices=("cuda:1",), draft_device="cuda:1")
    opts = RunnerOptions(draft="/d.gguf", flash_attention=True, kv_cache_type="q8_0")
    on_gpu = argv(opts, gpu)
    assert on_gpu[on_gpu.index("--device-draft") + 1] == "CUDA1" and on_gpu[on_gpu.index("--spec-draft-ngl") + 1] == "all"
    assert on_gpu[on_gpu.index("--cache-type-k-draft") + 1] == "q8_0" == on_gpu[on_gpu.index("--cache-type-v-draft") + 1]
    # A declared inventory runs children on the CPU: the draft too.
    declared = argv(opts, gpu, accounting_only=True)
    assert declared[declared.index("--device-draft") + 1] == "none"


def test_drafted_and_accepted_from_the_end_of_an_answer() -> None:
    final = (b'data: {"choices":[],"usage":{"completion_tokens":200},"timings":{"predicted_n":200,'
             b'"predicted_ms":6150.6,"draft_n":58,"draft_n_accepted":45}}\n\ndata: [DONE]\n\n')  # fmt: skip
    assert drafted_accepted(final) == (58, 45)
    assert drafted_accepted(b'{"timings":{"predicted_n":3}}') is None
    # Generated text that spells the field is escaped in JSON: never counted.
    sneaky = b'{"content":"{\\"draft_n\\":9,\\"draft_n_accepted\\":9}","timings":{"predicted_n":1}}'
    assert drafted_accepted(sneaky) is None
    assert drafted_accepted(sneaky[:-2] + b',"draft_n":2,"draft_n_accepted":1}}') == (2, 1)


def test_models_toml_keys(tmp_path: Path) -> None:
    text = """
[models.coder]
path = "c.gguf"
speculation = "ngram-map-k"
[models.plain]
path = "p.gguf"
speculation = false
[models.big]
path = "b.gguf"
draft = "small"
[models.bad-kind]
path = "x.gguf"
speculation = "warp"
[models.bad-draft]
path = "x.gguf"
draft = 7
[models.contradiction]
path = "x.gguf"
draft = "small"
speculation = "off"
"""
    cat = parse_catalogue(text, "models.toml", tmp_path)
    by_name = {e.name: e for e in cat.entries}
    assert by_name["coder:latest"].speculation == "ngram-map-k"
    assert by_name["plain:latest"].speculation == "off"
    assert by_name["big:latest"].draft == "small:latest" and by_name["big:latest"].speculation is None
    problems = {p.key: p.reason for p in cat.problems if "does not exist" not in p.reason}
    assert set(problems) == {"models.bad-kind.speculation", "models.bad-draft.draft", "models.contradiction.draft"}
    assert "use one of off, ngram" in problems["models.bad-kind.speculation"]
    assert "not served" in problems["models.bad-draft.draft"]


def test_store_and_runner_options_carry_them(tmp_path: Path) -> None:
    from trioshed.api.state import AppState
    from trioshed.errors import DraftUnusable
    from trioshed.models.stores import Stores

    write_tiny_model(tmp_path / "a.gguf")
    write_tiny_model(tmp_path / "b.gguf", seed=3)
    (tmp_path / "models.toml").write_text(
        '[models.big]\npath = "a.gguf"\ndraft = "b"\n[models.off]\npath = "a.gguf"\nspeculation = "off"\n'
        '[models.lost]\npath = "a.gguf"\ndraft = "nowhere"\n'
    )
    stores = Stores(tmp_path)
    state = AppState(settings=Settings(models=tmp_path, speculation="ngram-mod"), store=stores, scheduler=None)  # type: ignore[arg-type]
    big = state.runner_options(stores.resolve("big"), {})
    assert big.draft == str(tmp_path / "b.gguf")
    assert state.runner_options(stores.resolve("off"), {}).speculation == "off"
    assert state.runner_options(stores.resolve("b"), {}).speculation == "ngram-mod"  # the setting
    with pytest.raises(DraftUnusable, match="model 'lost': its draft model 'nowhere:latest' cannot be used"):
        state.runner_options(stores.resolve("lost"), {})
    # A copy keeps both keys.
    stores.copy("big", "big2")
    assert stores.resolve("big2").draft == "b:latest"


def _est(layer: float, n: int, output: float = 0.5, compute: float = 0.5) -> MemoryEstimate:
    return MemoryEstimate(
        weights=int(layer * n * GiB), kv=0, output=int(output * GiB), token_embd=GiB // 4,
        compute_full=int(compute * GiB), compute_partial=int(compute * GiB), layers=(int(layer * GiB),) * n,
    )  # fmt: skip


def test_a_draft_model_is_counted_with_its_target() -> None:
    draft = _est(0.1, 4, output=0.1, compute=0.1)  # 0.4 + 0.1 + 0.1 on a GPU, 0.25 in system memory
    est = replace(_est(1, 8), draft=draft)
    assert est.total == _est(1, 8).total + draft.total
    assert est.cpu_total == _est(1, 8).cpu_total + draft.cpu_total
    one = [Device("cuda:0", "cuda", 0, 24 * GiB, 24 * GiB)]
    full = place(est, one, system_free=64 * GiB)
    assert isinstance(full, Placement) and full.draft_device == "cuda:0"
    alone = place(_est(1, 8), one, system_free=64 * GiB)
    assert isinstance(alone, Placement)
    # The draft's layers, output and compute on the GPU; its input layer in system memory.
    assert full.vram_total - alone.vram_total == sum(draft.layers) + draft.output + draft.compute_full
    assert full.ram - alone.ram == GiB // 4
    # A GPU too small for the target whole: partial offload, the draft in system memory.
    small = [Device("cuda:0", "cuda", 0, 6 * GiB, 6 * GiB)]
    partial = place(est, small, system_free=64 * GiB)
    assert isinstance(partial, Placement) and partial.draft_device is None and 0 < partial.n_gpu_layers <= 8
    partial_alone = place(_est(1, 8), small, system_free=64 * GiB)
    assert isinstance(partial_alone, Placement) and partial_alone.n_gpu_layers == partial.n_gpu_layers
    assert partial.ram - partial_alone.ram == draft.cpu_total
    # The draft tips the target off a GPU it alone would fill: then it is a partial offload.
    tight = [Device("cuda:0", "cuda", 0, 10 * GiB, int(est.total - draft.total + GiB // 8))]
    tipped = place(est, tight, system_free=64 * GiB)
    assert isinstance(tipped, Placement) and tipped.draft_device is None
    cpu_only = place(est, [], system_free=64 * GiB)
    assert isinstance(cpu_only, Placement) and cpu_only.ram == est.cpu_total


def test_estimate_of_a_model_drafting_for_itself(tiny_model: Path) -> None:
    meta = read_metadata(tiny_model)
    opts = RunnerOptions(num_ctx=512, num_parallel=2, cache_ram_mib=64, draft=str(tiny_model))
    with_draft = estimate(meta, opts, draft=meta)
    alone = estimate(meta, replace(opts, draft=""))
    assert with_draft.draft is not None and with_draft.draft.prompt_cache == 0  # one prompt cache: the target's
    assert with_draft.draft.kv == alone.kv and with_draft.draft.weights == alone.weights
    assert with_draft.total == 2 * alone.total and with_draft.cpu_total == 2 * alone.cpu_total - alone.prompt_cache


# b10068, gemma3-270m drafting for itself (-c 8192 -np 2, CPU), lines as llama-server logs them.
DRAFT_LOG = """
load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
llama_context:        CPU  output buffer size =     2.00 MiB
llama_kv_cache:        CPU KV buffer size =    24.00 MiB
llama_kv_cache: size =   24.00 MiB (  4096 cells,   3 layers,  2/2 seqs), K (f16):   12.00 MiB, V (f16):   12.00 MiB
llama_kv_cache:        CPU KV buffer size =    30.00 MiB
llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  2/2 seqs), K (f16):   15.00 MiB, V (f16):   15.00 MiB
sched_reserve:        CPU compute buffer size =    22.77 MiB
common_speculative_init_result: loading draft model '/m/gemma3-270m.gguf'
load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
llama_context:        CPU  output buffer size =     2.00 MiB
llama_kv_cache:        CPU KV buffer size =    24.00 MiB
llama_kv_cache: size =   24.00 MiB (  4096 cells,   3 layers,  2/2 seqs), K (f16):   12.00 MiB, V (f16):   12.00 MiB
llama_kv_cache:        CPU KV buffer size =    30.00 MiB
llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  2/2 seqs), K (f16):   15.00 MiB, V (f16):   15.00 MiB
sched_reserve:        CPU compute buffer size =    22.77 MiB
"""


def test_the_memory_log_adds_the_draft_models_buffers() -> None:
    mib = 1024 * 1024
    measured = parse_memory_log(DRAFT_LOG)
    assert measured is not None
    assert measured.model == {"CPU_Mapped": 2 * round(235.16 * mib)}
    assert measured.kv == 2 * 54 * mib
    assert measured.compute == {"CPU": 2 * round(22.77 * mib)} and measured.output == {"CPU": 4 * mib}


def test_vocabularies_compared_as_llama_cpp_does(tmp_path: Path, gemma_model: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf")
    b = write_tiny_model(tmp_path / "b.gguf", seed=5, n_layer=1)  # other weights, same vocabulary
    assert incompatibility(str(a), str(b)) == ""
    assert incompatibility(str(gemma_model), str(gemma_model)) == ""
    # What b10068 logs: "draft model bos tokens must match target model ... add: 1 - 1, id: 2 - 1"
    assert incompatibility(str(gemma_model), str(a)) == (
        "its BOS token differs (added: True, id 1; the target's: added: True, id 2)"
    )
    # One token's text changed (same length, so the file stays valid).
    data = a.read_bytes()
    at = data.index(b"<0x41>")
    c = tmp_path / "c.gguf"
    c.write_bytes(data[:at] + b"<0x42>" + data[at + 6 :])
    assert "token " in incompatibility(str(a), str(c)) and "'<0x42>'" in incompatibility(str(a), str(c))
