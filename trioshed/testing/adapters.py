"""LoRA adapters for tests and benchmarks, for any base model: random ``lora_a``/``lora_b`` pairs
shaped from the base's own header.

An adapter GGUF (what llama.cpp's ``convert_lora_to_gguf.py`` writes) has ``general.type =
adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and for each adapted weight
``blk.N.<name>.weight`` a pair ``blk.N.<name>.weight.lora_a`` (ggml shape ``{n_in, rank}``) and
``….lora_b`` (``{rank, n_out}``); llama.cpp adds ``scale * alpha / rank * B·(A·x)`` to the
weight's output. ``strength`` scales ``B``: the tests' adapters are strong enough that greedy
tokens differ from the base's (:func:`write_lora` on the tiny models), a benchmark's mild
enough that a real model still writes text. The same arguments give the same bytes.

:func:`trioshed.testing.tiny.write_tiny_lora` is the tiny default shape's (no header read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trioshed.models.gguf_meta import read_metadata
from trioshed.models.tiny_gguf import gguf_written_atomically

__all__ = ["write_lora"]


def write_lora(
    path: str | os.PathLike[str],
    base: str | os.PathLike[str],
    *,
    targets: Sequence[str] = ("attn_q", "ffn_up"),
    rank: int = 4,
    alpha: float = 8.0,
    strength: float = 1.0,
    seed: int = 1,
    layers: Sequence[int] | None = None,
) -> Path:
    """Write a random LoRA adapter for the model file ``base`` to ``path`` (atomically).

    ``targets``: the weights adapted in each layer (``blk.N.<target>.weight``: those the base
    has); ``layers``: which layers (all by default). Raises ValueError when the base has none of
    the targets."""
    meta = read_metadata(os.fspath(base))
    rng = np.random.default_rng(seed)
    wanted = set(range(meta.block_count)) if layers is None else set(layers)
    pairs: list[tuple[str, np.ndarray, np.ndarray]] = []
    for t in meta.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in targets or parts[3] != "weight" or len(t.shape) != 2:
            continue
        if int(parts[1]) not in wanted:
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        # numpy (rows, cols) is ggml's {ne0 = cols, ne1 = rows}: a is {n_in, rank}, b {rank, n_out}
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * strength).astype(np.float32)
        pairs.append((t.name, a, b))
    if not pairs:
        raise ValueError(f"{base} has none of the weights {list(targets)} to adapt")
    target = Path(path)
    with gguf_written_atomically(target, meta.architecture or "llama") as writer:
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", alpha)
        for name, a, b in pairs:
            writer.add_tensor(f"{name}.lora_a", a)
            writer.add_tensor(f"{name}.lora_b", b)
    return target
