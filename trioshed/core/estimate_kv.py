"""The KV cache's share of the estimate (:mod:`trioshed.core.estimate`): which cache type a runner
really uses, its batch sizes, the cells each layer holds (sliding-window layers their own, smaller
cache) and their bytes; and :class:`MetadataLike`, what the estimate reads from a GGUF header.
Pure, as the estimate is; the terms are the estimate's docstring's ``kv``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gguf

from trioshed.core.model import RunnerOptions

#: Default micro-batch of llama-server (``--ubatch-size``), what generating runners keep.
N_UBATCH = 512
#: llama.cpp pads context sizes (and the SWA cache) to multiples of this.
CTX_PAD = 256
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


def row_bytes(kind: str, n: int) -> int:
    block, size = KV_BYTES[kind]
    return -(-n // block) * size


def pad_cells(n: int, to: int = CTX_PAD) -> int:
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
    n_ctx = pad_cells(opts.kv_cells if opts.kv_cells > 0 else meta.context_length)
    n_ctx_seq = pad_cells(n_ctx // n_seq) if n_seq > 1 else n_ctx
    full = n_ctx_seq * n_seq
    window = meta.sliding_window or 0
    n_ubatch = batch_sizes(opts)[1]
    swa = full if opts.swa_full else pad_cells(min(n_ctx_seq, window + n_ubatch)) * n_seq
    return tuple(swa if is_swa else full for is_swa in swa_layers(meta))


def kv_layer_bytes(meta: MetadataLike, opts: RunnerOptions) -> tuple[int, ...]:
    """The KV cache bytes of each layer (K and V together)."""
    kind = effective_kv_type(opts, meta)
    heads = meta.head_count_kv_per_layer()
    k_len, v_len = meta.key_length, meta.value_length
    return tuple(
        cells * (row_bytes(kind, k_len * h) + row_bytes(kind, v_len * h)) if h else 0
        for cells, h in zip(kv_cells(meta, opts), heads, strict=True)
    )
