"""The verbose-log parser turns llama-server's buffer reports into MeasuredMemory."""

from __future__ import annotations

from trioshed.core.model import MiB
from trioshed.runner.memlog import MemoryLogParser, parse_memory_log

GEMMA_LOG = """\
0.00.036.588 I srv    load_model: loading model '/models/gemma3-270m.gguf'
0.01.095.330 I load_tensors: loading model tensors, this can take a while... (mmap = true)
0.01.095.331 I load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
0.01.100.000 I llama_context: n_ctx         = 4096
0.01.100.001 I llama_context:        CPU  output buffer size =     4.00 MiB
0.01.100.002 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 1024 cells
0.01.100.003 I llama_kv_cache:        CPU KV buffer size =    12.00 MiB
0.01.100.004 I llama_kv_cache: size =   12.00 MiB (  1024 cells,   3 layers,  4/4 seqs), K (f16):    6.00 MiB, V (f16):    6.00 MiB
0.01.100.005 I llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
0.01.100.006 I llama_kv_cache:        CPU KV buffer size =    60.00 MiB
0.01.100.007 I llama_kv_cache: size =   60.00 MiB (  1024 cells,  15 layers,  4/4 seqs), K (f16):   30.00 MiB, V (f16):   30.00 MiB
0.01.200.000 I sched_reserve:        CPU compute buffer size =    20.77 MiB
0.01.200.001 I sched_reserve: graph nodes  = 1000
"""


def test_gemma_style_log_with_two_kv_caches() -> None:
    m = parse_memory_log(GEMMA_LOG)
    assert m is not None
    assert m.model == {"CPU_Mapped": round(235.16 * MiB)}
    assert m.kv == 72 * MiB
    assert m.kv_k == m.kv_v == 36 * MiB
    assert m.compute == {"CPU": round(20.77 * MiB)}
    assert m.output == {"CPU": 4 * MiB}
    assert m.total == m.weights + m.kv + m.compute["CPU"] + 4 * MiB


def test_incremental_feeding_and_nothing_before_the_model() -> None:
    parser = MemoryLogParser()
    assert parser.result() is None
    lines = GEMMA_LOG.splitlines(keepends=True)
    for line in lines[:2]:
        parser.feed(line)
    assert parser.result() is None
    parser.feed(lines[2])
    first = parser.result()
    assert first is not None and first.kv == 0 and first.compute == {}
    for line in lines[3:]:
        parser.feed(line)
    assert parser.kv_caches == 2
    assert parser.kv_types == ("f16", "f16")
    final = parser.result()
    assert final is not None and final.kv == 72 * MiB


def test_gpu_buffers_and_repeated_compute_reports() -> None:
    log = """\
load_tensors: offloaded 19/19 layers to GPU
load_tensors:        CUDA0 model buffer size =   700.50 MiB
load_tensors:   CPU_Mapped model buffer size =   170.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =   256.00 MiB
llama_kv_cache: size =  256.00 MiB (  8192 cells,  16 layers,  1/1 seqs), K (q8_0):  128.00 MiB, V (q8_0):  128.00 MiB
sched_reserve:      CUDA0 compute buffer size =   300.00 MiB
sched_reserve:  CUDA_Host compute buffer size =    20.00 MiB
sched_reserve:      CUDA0 compute buffer size =   310.25 MiB
"""
    m = parse_memory_log(log)
    assert m is not None
    assert m.model == {"CUDA0": round(700.5 * MiB), "CPU_Mapped": 170 * MiB}
    assert m.kv == 256 * MiB
    assert m.compute == {"CUDA0": round(310.25 * MiB), "CUDA_Host": 20 * MiB}


def test_breakdown_table_is_a_fallback_for_the_model_size() -> None:
    log = """\
llama_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
llama_memory_breakdown_print: |   - CUDA0 (H200)       | 143000 = 142000 + (  900 =   700 +     150 +      50) +         100 |
llama_memory_breakdown_print: |   - Host               |                  285 =   235 +      28 +      21                |
"""
    m = parse_memory_log(log)
    assert m is not None
    assert m.model == {"CUDA0 (H200)": 700 * MiB, "Host": 235 * MiB}


def test_unrelated_lines_are_ignored() -> None:
    assert (
        parse_memory_log("srv  log_server_r: request: GET /health 127.0.0.1 200\nsize = 3\n")
        is None
    )


#: A tiny model with the tiny gemma3 vision projector (trioshed.testing.vision), as b10068 logs it.
VISION_LOG = """\
0.00.153.636 I load_tensors:   CPU_Mapped model buffer size =     0.38 MiB
0.00.154.020 I llama_context:        CPU  output buffer size =     0.00 MiB
0.00.154.121 I llama_kv_cache:        CPU KV buffer size =     0.25 MiB
0.00.155.909 I sched_reserve:        CPU compute buffer size =     1.51 MiB
0.00.169.253 I clip_model_loader: has vision encoder
0.00.170.162 I clip_ctx: CLIP using CPU backend
0.00.170.812 I load_hparams: model size:         0.09 MiB
0.00.170.836 I load_hparams: metadata size:      0.01 MiB
0.00.174.184 I reserve_compute_meta:        CPU compute buffer size =     0.04 MiB
0.00.174.285 I srv    load_model: loaded multimodal model, 'mmproj.gguf'
0.09.511.562 I sched_reserve:        CPU compute buffer size =     1.51 MiB
"""


def test_a_projector_is_counted_beside_the_model_not_over_it() -> None:
    m = parse_memory_log(VISION_LOG)
    assert m is not None
    assert m.compute == {"CPU": round(1.51 * MiB)}  # the model's, not the projector's 0.04
    assert m.projector == {"CPU": round(0.09 * MiB)}
    assert m.projector_compute == {"CPU": round(0.04 * MiB)}
    assert m.total == round(0.38 * MiB) + round(0.25 * MiB) + round(1.51 * MiB) + round(0.09 * MiB) + round(0.04 * MiB)
    assert m.by_backend()["CPU"] == m.total - round(0.38 * MiB)


def test_a_projector_on_a_gpu_and_two_projector_contexts() -> None:
    log = VISION_LOG.replace("CLIP using CPU backend", "CLIP using Vulkan0 backend").replace(
        "reserve_compute_meta:        CPU", "reserve_compute_meta:    Vulkan0"
    ) + "clip_ctx: CLIP using Vulkan0 backend\nload_hparams: model size:   0.13 MiB\nreserve_compute_meta:    Vulkan0 compute buffer size =     3.66 MiB\n"
    m = parse_memory_log(log)
    assert m is not None
    assert m.projector == {"Vulkan0": round(0.09 * MiB) + round(0.13 * MiB)}
    assert m.projector_compute == {"Vulkan0": round(0.04 * MiB) + round(3.66 * MiB)}
    assert m.compute == {"CPU": round(1.51 * MiB)}


def test_lora_buffers_are_summed_per_buffer_and_counted_with_the_rest() -> None:
    """Each adapter reports a line per buffer it uses (the buffer of the layers it adapts):
    measured on b10068 with two adapters and ``-ngl 2`` on Vulkan."""
    log = GEMMA_LOG + """\
0.01.300.000 I llama_adapter_lora_init_impl: loading lora adapter from '/m/a.gguf' ...
0.01.300.001 I llama_adapter_lora_init_impl:      Vulkan0 LoRA buffer size =     0.16 MiB
0.01.300.002 I llama_adapter_lora_init_impl:   CPU_Mapped LoRA buffer size =     0.31 MiB
0.01.300.003 I llama_adapter_lora_init_impl: loaded 12 tensors from lora file
0.01.300.004 I llama_adapter_lora_init_impl:      Vulkan0 LoRA buffer size =     0.06 MiB
0.01.300.005 I llama_adapter_lora_init_impl:   CPU_Mapped LoRA buffer size =     0.12 MiB
"""
    m = parse_memory_log(log)
    assert m is not None
    assert m.adapters == {"Vulkan0": round(0.16 * MiB) + round(0.06 * MiB), "CPU_Mapped": round(0.31 * MiB) + round(0.12 * MiB)}
    assert m.by_backend()["Vulkan0"] == sum(v for k, v in m.adapters.items() if k == "Vulkan0")
    assert m.total == parse_memory_log(GEMMA_LOG).total + sum(m.adapters.values())  # type: ignore[union-attr]
