"""The compute buffers' share of the estimate (:mod:`trioshed.core.estimate`): llama.cpp's graph
buffer and logits on the CPU, their split between a GPU and system memory with layers offloaded,
and the attention a device too small for its tensors leaves to the CPU. Pure, as the estimate
is; the terms are the estimate's docstring's ``compute_full`` / ``compute_partial``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trioshed.core.estimate_kv import (
    MetadataLike,
    batch_sizes,
    effective_kv_type,
    kv_cells,
    kv_layer_bytes,
    row_bytes,
    swa_layers,
)
from trioshed.core.model import RunnerOptions

#: Small graph tensors (positions, indices, norms) not worth modelling one by one.
GRAPH_SLACK = 64 * 1024


def _int(value: Any, default: int) -> int:
    if isinstance(value, tuple):
        return max(int(v) for v in value) if value else default
    return default if value is None else int(value)


def _caches(meta: MetadataLike, opts: RunnerOptions) -> list[int]:
    """Cells per stream of each attention cache: the full one and, with sliding-window layers,
    the window's (its own cache even when ``--swa-full`` makes it as large: measured on
    gemma3-270m, b10068)."""
    n_seq = max(1, opts.num_parallel)
    cells = kv_cells(meta, opts)
    flags = swa_layers(meta)
    out = []
    for swa in (False, True):
        layers = [c for c, f in zip(cells, flags, strict=True) if f == swa]
        if layers:
            out.append(layers[0] // n_seq)
    return sorted(out)


def _graph(
    meta: MetadataLike, opts: RunnerOptions, caches: Sequence[int], *, device: bool = False
) -> int:
    """The graph buffer (no logits) with the attention of ``caches`` in it (see
    :func:`compute_buffer`). ``device``: the Vulkan device's own graph, whose attention without
    flash attention keeps ``n_embd + 4 q + kv`` besides the scores (measured on gemma3-270m at
    2,048 to 32,768 cells: the scores plus 4,869 floats per token, where the CPU's
    ``n_embd + 5 q + 2 kv`` is 6,272)."""
    n_ubatch = batch_sizes(opts)[1]
    n_seq = max(1, opts.num_parallel)
    n_head = _int(meta.head_count, 0)
    n_head_kv = max(meta.head_count_kv_per_layer(), default=0)
    n_embd = meta.embedding_length
    n_ff = _int(meta.arch_get("feed_forward_length"), 4 * n_embd)
    q = n_head * meta.key_length
    kv = n_head_kv * max(meta.key_length, meta.value_length)
    fa = opts.flash_attention
    n_kv = max(caches, default=0)
    mask = sum(caches) * n_ubatch * (2 if fa else 4)
    if fa:
        attention = n_embd + 4 * q + 2 * kv
    elif device:
        attention = n_head * n_kv + n_embd + 4 * q + kv
    else:
        attention = n_head * n_kv + n_embd + 5 * q + 2 * kv
    feed_forward = 2 * n_embd + 4 * n_ff
    output = n_embd + (n_seq * meta.vocab_size + n_ubatch - 1) // n_ubatch
    graph = mask + n_ubatch * 4 * max(attention, feed_forward, output) + GRAPH_SLACK
    if fa:  # Q converted to the cache's dot-product type
        graph += n_ubatch * 4 * q
    return graph


def compute_buffer(meta: MetadataLike, opts: RunnerOptions, *, partial: bool = False) -> int:
    """Bytes of llama.cpp's compute (graph) buffer plus its logits output buffer.

    Derived from the CPU backend's reports over tiny models of different widths and gemma3-270m
    (``bench/results/estimate-vs-llamacpp.md``). llama.cpp reserves the prompt graph at
    ``n_ubatch`` tokens; ggml-alloc reuses memory between ops, so the buffer is the attention
    masks (inputs, alive throughout) plus the largest phase, per token, in f32:

    - attention without flash attention: the scores ``n_head x n_kv`` plus
      ``n_embd + 5 q + 2 kv`` (q = n_head x key_length, kv = n_head_kv x key_length);
    - attention with flash attention: ``n_embd + 4 q + 2 kv`` (no score matrix);
    - feed-forward: ``2 n_embd + 4 n_ff``;
    - output: ``n_embd``, plus ``n_seq x n_vocab`` logits.

    Masks are ``n_kv x n_ubatch`` per distinct cache (full and sliding window), f32 without flash
    attention and f16 with it; n_kv counts one stream's cells (each slot attends its own).
    Flash attention adds a copy of Q converted to the cache's type (``q`` per token). The output
    buffer llama-server keeps for logits is ``n_seq x n_vocab x 4``. These are the CPU backend's
    numbers; GPU backends allocate differently (:func:`gpu_compute_buffers`).

    ``partial`` (layers split between backends) adds the copy of the hidden state between them.
    """
    n_ubatch = batch_sizes(opts)[1]
    graph = _graph(meta, opts, _caches(meta, opts))
    if partial:
        graph += n_ubatch * 4 * meta.embedding_length
    return graph + max(1, opts.num_parallel) * meta.vocab_size * 4


def attention_on_host(meta: MetadataLike, opts: RunnerOptions, max_tensor: int) -> tuple[int, ...]:
    """The caches (cells per stream, as :func:`_caches`) whose attention a device that takes no
    tensor over ``max_tensor`` bytes leaves to the CPU (0: no limit).

    llama.cpp's Vulkan backend refuses an op when one of its tensors is larger than the device
    binds (``supports_op``: its largest buffer and ``maxStorageBufferRange``; lowering the first
    with ``GGML_VK_FORCE_MAX_BUFFER_SIZE`` moves the op as measured), and the scheduler then runs
    it on the CPU. The attention ops of a
    cache are the scores ``n_kv x n_ubatch x n_head`` f32 and their softmax without flash
    attention, reading the K and V views of the cache (``n_kv`` rows each) and the mask
    (``n_kv x n_ubatch``, f32, or f16 with flash attention). Measured on lavapipe (128 MiB),
    gemma3-270m without flash attention: 256 MiB of scores at 32,768 cells run on the CPU,
    128 MiB at 16,384 stay (a tensor of exactly the limit still fits); with flash attention, the
    256 MiB f16 mask at 262,144 cells sends it to the CPU too.
    """
    if max_tensor <= 0:
        return ()
    n_ubatch = batch_sizes(opts)[1]
    n_head = _int(meta.head_count, 0)
    n_head_kv = max(meta.head_count_kv_per_layer(), default=0)
    kind = effective_kv_type(opts, meta)
    k_row = row_bytes(kind, meta.key_length * n_head_kv)
    v_row = row_bytes(kind, meta.value_length * n_head_kv)
    fa = opts.flash_attention
    out = []
    for n_kv in _caches(meta, opts):
        scores = 0 if fa else n_kv * n_ubatch * n_head * 4
        mask = n_kv * n_ubatch * (2 if fa else 4)
        if max(scores, mask, n_kv * k_row, n_kv * v_row) > max_tensor:
            out.append(n_kv)
    return tuple(out)


def gpu_compute_buffers(
    meta: MetadataLike, opts: RunnerOptions, *, max_tensor: int = 0
) -> tuple[int, int, int, int]:
    """(GPU full, GPU partial, host full, host partial) compute bytes with layers on a GPU.

    Measured on Vulkan (lavapipe, b10068; ``bench/results/estimate-vs-llamacpp.md``): with any
    layer offloaded llama.cpp splits the graph in two buffers.

    - On the GPU: the graph of :func:`compute_buffer` without the logits (they are read back to
      the host) and with the device's attention term (:func:`_graph`); with flash attention
      also without the copy of Q in the cache's type (the Vulkan kernel reads Q as it is) and
      one ``n_embd x n_ubatch`` row block (the input rows live on the host). With only some
      layers offloaded, llama.cpp still runs the big products of the CPU layers on the GPU (op
      offload) and copies a CPU layer's KV cache there for it: add the largest layer's KV cache
      and the hidden state crossing between the backends.
    - In system memory (``Vulkan_Host compute``, the CPU backend's buffer): the attention masks
      (f32, or f16 with flash attention), the input rows from ``token_embd`` and their
      neighbours: 4 (3 with flash attention) ``n_embd x n_ubatch`` f32 tensors, one more at
      partial offload; plus the logits output buffer (``Vulkan_Host output``). Measured: 4 and
      2-2.5 (gemma3 at 8192 cells); 3 keeps the estimate from falling under.

    ``max_tensor``: the largest tensor the device takes (``Device.max_tensor``; 0: no limit).
    The attention of a cache whose tensors exceed it runs on the CPU
    (:func:`attention_on_host`): its mask is no longer copied to the device and its scores
    leave the device's graph; the host buffer gains, for the largest such cache (each layer's
    CPU split reuses the last one's memory), the scores (without flash attention) and the
    copies of the K and V views and of Q the CPU computes from.
    """
    n_ubatch = batch_sizes(opts)[1]
    n_seq = max(1, opts.num_parallel)
    logits = n_seq * meta.vocab_size * 4
    fa = opts.flash_attention
    q = _int(meta.head_count, 0) * meta.key_length
    caches = _caches(meta, opts)
    on_host = attention_on_host(meta, opts, max_tensor)
    on_device = list(caches)
    for n_kv in on_host:
        on_device.remove(n_kv)
    graph = _graph(meta, opts, on_device, device=True)
    per_stream = sorted({c // n_seq for c in kv_cells(meta, opts)})
    masks = sum(per_stream) * n_ubatch * (2 if fa else 4)
    row = meta.embedding_length * n_ubatch * 4
    if fa:
        graph -= n_ubatch * 4 * q + row
    host_full = masks + (3 if fa else 4) * row + logits
    if on_host:
        n_kv = max(on_host)
        n_head_kv = max(meta.head_count_kv_per_layer(), default=0)
        kind = effective_kv_type(opts, meta)
        views = n_kv * (
            row_bytes(kind, meta.key_length * n_head_kv)
            + row_bytes(kind, meta.value_length * n_head_kv)
        )
        scores = 0 if fa else n_kv * n_ubatch * _int(meta.head_count, 0) * 4
        host_full += scores + views + n_ubatch * 4 * q
    largest_kv = max(kv_layer_bytes(meta, opts), default=0)
    return graph, graph + row + largest_kv, host_full, host_full + row
