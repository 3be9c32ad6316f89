"""Predict what llama-server will allocate for a model and a set of runner options.

Pure: takes the parsed GGUF header (:class:`~trioshed.models.gguf_meta.GGUFMetadata`, or anything
with the same attributes) and :class:`~trioshed.core.model.RunnerOptions`, returns a
:class:`~trioshed.core.model.MemoryEstimate`. Each term follows what llama.cpp does (read in its
source, build 11434), and ``tests/core/test_estimate.py`` checks them against llama-server's verbose
log on real CPU runs (``bench/results/estimate-vs-llamacpp.md``: within 1 % for weights and KV,
within 4 % overall). With layers on a GPU the compute buffers split between the GPU and system
memory (:func:`~trioshed.core.estimate_compute.gpu_compute_buffers`, measured on Vulkan devices: the same table's Vulkan rows);
on a device that takes no tensor as big as a cache's attention scores, that attention runs on
the CPU and its buffers move to system memory (:func:`~trioshed.core.estimate_compute.attention_on_host`).

weights
    Repeating layers: every ``blk.N.*`` tensor, byte for byte as stored (``layers[i]`` adds layer
    i's KV cache: the unit that ``-ngl`` moves to a GPU).
token_embd
    The input layer (``token_embd``, ``position_embd``, ``token_types``): llama.cpp always keeps it
    in system memory, whatever ``-ngl`` says.
output
    ``output_norm`` + ``output.weight`` + other non-layer tensors. Models with tied embeddings
    (gemma3) have no ``output.weight``: llama.cpp then loads ``token_embd.weight`` a second time
    for the output layer. On a GPU that copy costs its full size; on the CPU with mmap it is the
    same mapped bytes, so ``MemoryEstimate.output_shared`` says how much of ``output`` is free on
    the CPU.
kv
    Per layer: cells x (key_length + value_length) x head_count_kv[layer], in the cache type's
    bytes per element. The runner's context is ``num_ctx x num_parallel`` cells, padded to 256
    (per sequence: llama-server gives each slot its own stream). Sliding-window layers (gemma3:
    five of every six) get their own, smaller cache:
    ``pad256(min(n_ctx_seq, n_swa + n_ubatch))`` cells per stream, unless ``--swa-full``
    (``RunnerOptions.swa_full``, for warm returns) makes them full-size.
    Quantized caches (q8_0, q4_0) need flash attention and a head width their block divides;
    otherwise the runner uses f16 and so does the estimate (:func:`~trioshed.core.estimate_kv.effective_kv_type`).
cpu_repack
    On the CPU, llama.cpp keeps a second, repacked copy of Q4_0/Q4_K/IQ4_NL matrices
    (``CPU_REPACK`` buffer): counted in ``cpu_total`` and, per CPU layer, in partial offload.
compute_full / compute_partial
    The graph buffers plus the logits output buffer (see :func:`~trioshed.core.estimate_compute.compute_buffer`).
prompt_cache
    llama-server's host-memory prompt cache, ``--cache-ram`` MiB: a positive limit binds in
    bytes (b10068 raises its token limit to what fits), so the whole limit is counted.
"""

from __future__ import annotations

import re
from dataclasses import replace

import gguf

from trioshed.core.estimate_compute import compute_buffer, gpu_compute_buffers
from trioshed.core.estimate_kv import MetadataLike, kv_layer_bytes
from trioshed.core.model import MemoryEstimate, RunnerOptions

__all__ = ["estimate"]

_Q = gguf.GGMLQuantizationType
#: Weight types the CPU backend copies into a repacked layout (``CPU_REPACK`` buffer) for faster
#: matrix products on x86 (AVX2): the copy is extra system memory while the layer is on the CPU.
REPACKED_TYPES = frozenset({_Q.Q4_0, _Q.Q4_K, _Q.IQ4_NL})

_LAYER = re.compile(r"^blk\.(\d+)\.")
_INPUT_PREFIXES = ("token_embd.", "position_embd.", "token_types.")


def estimate(
    meta: MetadataLike,
    opts: RunnerOptions,
    *,
    projector_bytes: int = 0,
    adapter_bytes: int = 0,
    draft: MetadataLike | None = None,
    max_tensor: int = 0,
) -> MemoryEstimate:
    """What a runner of ``meta`` with ``opts`` needs, split the way placement moves it.

    ``draft``: the draft model's header (``opts.draft``); its estimate, with the target's
    context, slots and batch and no prompt cache of its own, rides in ``MemoryEstimate.draft``.
    ``max_tensor``: the largest tensor the GPUs take (``Device.max_tensor``, 0: no limit); the
    attention over a cache too big for it is computed in system memory (:func:`~trioshed.core.estimate_compute.gpu_compute_buffers`).
    """
    n_layer = meta.block_count
    layer_weights = [0] * n_layer
    token_embd = 0
    output = 0
    has_output_weight = False
    embd_weight = 0
    output_weight = 0
    repack = 0
    for t in meta.tensors:
        repackable = t.ggml_type in REPACKED_TYPES and len(t.shape) == 2 and t.shape[1] % 8 == 0
        if repackable and not opts.batch_invariant:  # --no-repack keeps no second copy
            if not t.name.startswith(_INPUT_PREFIXES):  # looked up by row, never multiplied
                repack += t.nbytes
        m = _LAYER.match(t.name)
        if m:
            il = int(m[1])
            if il < n_layer:
                layer_weights[il] += t.nbytes
            else:  # extra layers (e.g. next-token-prediction heads) stay with the output
                output += t.nbytes
        elif t.name.startswith(_INPUT_PREFIXES):
            token_embd += t.nbytes
            if t.name == "token_embd.weight":
                embd_weight = t.nbytes
        else:
            output += t.nbytes
            if t.name == "output.weight":
                has_output_weight = True
                output_weight = t.nbytes
    output_shared = 0
    output_tensor = output_weight
    if not has_output_weight and embd_weight:
        output_tensor = embd_weight
        output_shared = embd_weight
        output += embd_weight
    kv_layers = kv_layer_bytes(meta, opts)
    gpu_full, gpu_partial, host_full, host_partial = gpu_compute_buffers(
        meta, opts, max_tensor=max_tensor
    )
    return MemoryEstimate(
        weights=sum(layer_weights),
        kv=sum(kv_layers),
        output=output,
        token_embd=token_embd,
        compute_full=compute_buffer(meta, opts),
        compute_partial=compute_buffer(meta, opts, partial=True),
        layers=tuple(w + kv for w, kv in zip(layer_weights, kv_layers, strict=True)),
        projector=projector_bytes,
        adapters=adapter_bytes,
        output_shared=output_shared,
        cpu_repack=repack,
        prompt_cache=max(0, opts.cache_ram_mib) * 1024 * 1024,
        gpu_compute_full=gpu_full,
        gpu_compute_partial=gpu_partial,
        host_compute_full=host_full,
        host_compute_partial=host_partial,
        output_tensor=output_tensor,
        draft=(
            estimate(draft, replace(opts, cache_ram_mib=0, draft=""), max_tensor=max_tensor)
            if draft is not None
            else None
        ),
    )
