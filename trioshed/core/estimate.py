"""Predict what llama-server will allocate for a model and a set of runner options.

Pure: takes the parsed GGUF header (:class:`~trioshed.models.gguf_meta.GGUFMetadata`, or anything
with the same attributes) and :class:`~trioshed.core.model.RunnerOptions`, returns a
:class:`~trioshed.core.model.MemoryEstimate`. Each term follows what llama.cpp does (read in its
source, build 11434), and ``tests/core/test_estimate.py`` checks them against llama-server's verbose
log on real CPU runs (``bench/results/estimate-vs-llamacpp.md``: within 1 % for weights and KV,
within 4 % overall). With layers on a GPU the compute buffers split between the GPU and system
memory (:func:`gpu_compute_buffers`, measured on Vulkan devices: the same table's Vulkan rows);
on a device that takes no tensor as big as a cache's attention scores, that attention runs on
the CPU and its buffers move to system memory (:func:`attention_on_host`).

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
    otherwise the runner uses f16 and so does the estimate (:func:`effective_kv_type`).
cpu_repack
    On the CPU, llama.cpp keeps a second, repacked copy of Q4_0/Q4_K/IQ4_NL matrices
    (``CPU_REPACK`` buffer): counted in ``cpu_total`` and, per CPU layer, in partial offload.
compute_full / compute_partial
    The graph buffers plus the logits output buffer (see :func:`compute_buffer`).
prompt_cache
    llama-server's host-memory prompt cache, ``--cache-ram`` MiB: a positive limit binds in
    bytes (b10068 raises its token limit to what fits), so the whole limit is counted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import gguf

from trioshed.core.model import MemoryEstimate, RunnerOptions

__all__ = [
    "KV_BYTES",
    "MetadataLike",
    "attention_on_host",
    "batch_sizes",
    "compute_buffer",
    "effective_kv_type",
    "estimate",
    "gpu_compute_buffers",
    "kv_cells",
    "kv_layer_bytes",
    "swa_layers",
]

#: Default micro-batch of llama-server (``--ubatch-size``), what generating runners keep.
N_UBATCH = 512
#: llama.cpp pads context sizes (and the SWA cache) to multiples of this.
CTX_PAD = 256
#: Small graph tensors (positions, indices, norms) not worth modelling one by one.
GRAPH_SLACK = 64 * 1024

_Q = gguf.GGMLQuantizationType
#: (block size, bytes per block) of each KV cache type.
KV_BYTES: dict[str, tuple[int, int]] = {
    "f32": gguf.GGML_QUANT_SIZES[_Q.F32],
    "f16": gguf.GGML_QUANT_SIZES[_Q.F16],
    "bf16": gguf.GGML_QUANT_SIZES[_Q.BF16],
    "q8_0": gguf.GGML_QUANT_SIZES[_Q.Q8_0],
    "q4_0": gguf.GGML_QUANT_SIZES[_Q.Q4_0],
    "q4_1": gguf.GGML_QUANT_SIZES[_Q.Q4_1],
    "q5_0": gguf.GGML_QUANT_SIZES[_Q.Q5_0],
    "q5_1": gguf.GGML_QUANT_SIZES[_Q.Q5_1],
    "iq4_nl": gguf.GGML_QUANT_SIZES[_Q.IQ4_NL],
}

#: The sliding-window period llama.cpp assumes per architecture when the file has no
#: ``attention.sliding_window_pattern``: (period n, dense_first). Layer il uses the window unless
#: il % n == n - 1 (or il % n == 0 when dense_first). From llama.cpp's ``load_swa_pattern`` calls.
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma-embedding": (6, False),
    "gemma3n": (5, False),
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone4": (4, False),
    "exaone-moe": (4, False),
    "gpt-oss": (2, False),
    "olmo2": (4, False),
    "afmoe": (4, False),
    "smallthinker": (4, True),
    "modern-bert": (3, True),
    "plamo3": (8, False),
}

#: Weight types the CPU backend copies into a repacked layout (``CPU_REPACK`` buffer) for faster
#: matrix products on x86 (AVX2): the copy is extra system memory while the layer is on the CPU.
REPACKED_TYPES = frozenset({_Q.Q4_0, _Q.Q4_K, _Q.IQ4_NL})

_LAYER = re.compile(r"^blk\.(\d+)\.")
_INPUT_PREFIXES = ("token_embd.", "position_embd.", "token_types.")


class MetadataLike(Protocol):
    """What :func:`estimate` reads from a GGUF header (``GGUFMetadata`` provides it)."""

    @property
    def fields(self) -> Mapping[str, Any]: ...
    @property
    def architecture(self) -> str: ...
    @property
    def block_count(self) -> int: ...
    @property
    def key_length(self) -> int: ...
    @property
    def value_length(self) -> int: ...
    @property
    def embedding_length(self) -> int: ...
    @property
    def head_count(self) -> int | tuple[int, ...]: ...
    @property
    def context_length(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def sliding_window_pattern(self) -> int | tuple[bool, ...] | None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tensors(self) -> Sequence[Any]: ...

    def head_count_kv_per_layer(self) -> tuple[int, ...]: ...
    def arch_get(self, suffix: str, default: Any = None) -> Any: ...


def effective_kv_type(opts: RunnerOptions, meta: MetadataLike | None = None) -> str:
    """The cache type the runner really uses (pass it to ``--cache-type-k/-v``).

    Quantized caches need flash attention, and llama.cpp refuses a cache type whose block size
    does not divide the per-head key/value width (``K cache type q8_0 with block size 32 does
    not divide n_embd_head_k=16``): both fall back to f16.
    """
    kind = opts.kv_cache_type.lower()
    if kind not in KV_BYTES:
        raise ValueError(
            f"unknown KV cache type {opts.kv_cache_type!r}; use one of {sorted(KV_BYTES)}"
        )
    if kind in ("f16", "f32", "bf16"):
        return kind
    if not opts.flash_attention:
        return "f16"
    if meta is not None:
        block = KV_BYTES[kind][0]
        if meta.key_length % block or meta.value_length % block:
            return "f16"
    return kind


def batch_sizes(opts: RunnerOptions) -> tuple[int, int]:
    """``(--batch-size, --ubatch-size)`` of a runner: ``runner.command`` passes them and every
    term below that depends on the micro-batch reads them here, so the two cannot drift apart.

    A generating runner keeps ``num_batch`` and llama-server's default micro-batch (512, never
    above the batch). An embedding or rerank runner must see one whole input (a query-document
    pair) in one micro-batch: llama-server refuses a longer one ("input is too large to
    process"), so both are the slot's context (``num_ctx``), or ``num_batch`` when larger.
    """
    if opts.embedding:
        n = max(opts.num_batch, opts.num_ctx)
        return n, n
    return opts.num_batch, min(opts.num_batch, N_UBATCH)


def _row_bytes(kind: str, n: int) -> int:
    block, size = KV_BYTES[kind]
    return -(-n // block) * size


def _pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to


def swa_layers(meta: MetadataLike) -> tuple[bool, ...]:
    """Which layers use the sliding window (all False when the model has none)."""
    n_layer = meta.block_count
    window = meta.sliding_window
    if not window:
        return (False,) * n_layer
    pattern = meta.sliding_window_pattern
    if isinstance(pattern, tuple):
        flags = tuple(bool(x) for x in pattern[:n_layer])
        return flags + (False,) * (n_layer - len(flags))
    period, dense_first = SWA_PATTERNS.get(meta.architecture, (0, False))
    if isinstance(pattern, int):
        period = pattern
    if period == 0:
        return (True,) * n_layer
    if dense_first:
        return tuple(il % period != 0 for il in range(n_layer))
    return tuple(il % period < period - 1 for il in range(n_layer))


def kv_cells(meta: MetadataLike, opts: RunnerOptions) -> tuple[int, ...]:
    """KV cells per layer, as llama.cpp allocates them for ``opts`` (all streams together).

    llama-server (``-c num_ctx*num_parallel -np num_parallel``) gives each slot its own stream of
    ``pad256(num_ctx)`` cells; sliding-window layers hold ``pad256(min(that, n_swa + n_ubatch))``
    cells per stream (full-size with ``--swa-full``).
    """
    n_seq = max(1, opts.num_parallel)
    # ``-c 0`` (num_ctx 0) makes llama.cpp use the training context for all slots together.
    n_ctx = _pad(opts.kv_cells if opts.kv_cells > 0 else meta.context_length)
    n_ctx_seq = _pad(n_ctx // n_seq) if n_seq > 1 else n_ctx
    full = n_ctx_seq * n_seq
    window = meta.sliding_window or 0
    n_ubatch = batch_sizes(opts)[1]
    swa = full if opts.swa_full else _pad(min(n_ctx_seq, window + n_ubatch)) * n_seq
    return tuple(swa if is_swa else full for is_swa in swa_layers(meta))


def kv_layer_bytes(meta: MetadataLike, opts: RunnerOptions) -> tuple[int, ...]:
    """The KV cache bytes of each layer (K and V together)."""
    kind = effective_kv_type(opts, meta)
    heads = meta.head_count_kv_per_layer()
    k_len, v_len = meta.key_length, meta.value_length
    return tuple(
        cells * (_row_bytes(kind, k_len * h) + _row_bytes(kind, v_len * h)) if h else 0
        for cells, h in zip(kv_cells(meta, opts), heads, strict=True)
    )


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
    k_row = _row_bytes(kind, meta.key_length * n_head_kv)
    v_row = _row_bytes(kind, meta.value_length * n_head_kv)
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
            _row_bytes(kind, meta.key_length * n_head_kv)
            + _row_bytes(kind, meta.value_length * n_head_kv)
        )
        scores = 0 if fa else n_kv * n_ubatch * _int(meta.head_count, 0) * 4
        host_full += scores + views + n_ubatch * 4 * q
    largest_kv = max(kv_layer_bytes(meta, opts), default=0)
    return graph, graph + row + largest_kv, host_full, host_full + row


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
    attention over a cache too big for it is computed in system memory (:func:`gpu_compute_buffers`).
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
