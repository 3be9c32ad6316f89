"""The memory of LoRA adapters, where llama.cpp puts it (pure).

llama.cpp allocates each adapter tensor on the buffer of the base tensor it adapts
(``llama_adapter_lora_init_impl``, one "LoRA buffer size" line per buffer type and adapter):
the ``lora_a``/``lora_b`` pair of ``blk.N.attn_q.weight`` lives where layer N's weights live, so
an adapter's bytes move with ``-ngl`` exactly as its layers do. So they are folded into the
estimate per layer (:func:`with_adapters`): a repeating layer's adapter tensors into that layer,
the token embedding's into the input part, the rest (``output``) into the output part; placement
then puts each where its layer goes, and a runner whose group holds many adapters is planned at
its true size. Checked against llama-server's "LoRA buffer size" lines (``tests/core``).

Pure: headers are read by the caller (a tensor list per adapter: name and bytes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from trioshed.core.model import MemoryEstimate

__all__ = ["AdapterBytes", "adapter_bytes", "with_adapters"]

_LAYER = re.compile(r"blk\.(\d+)\.")
_INPUT = ("token_embd.", "token_types.", "position_embd.")


@dataclass(frozen=True)
class AdapterBytes:
    """One adapter's tensor bytes by where they go: per repeating layer, input, output."""

    layers: tuple[int, ...]
    token_embd: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return sum(self.layers) + self.token_embd + self.output


def adapter_bytes(tensors: Iterable[tuple[str, int]], n_layer: int) -> AdapterBytes:
    """An adapter's ``(name, bytes)`` tensors, sorted by the base layer each adapts (a layer
    beyond the model's ``n_layer`` stays with the output, as its weights do)."""
    layers = [0] * n_layer
    token_embd = output = 0
    for name, n in tensors:
        m = _LAYER.match(name)
        if m and int(m[1]) < n_layer:
            layers[int(m[1])] += n
        elif name.startswith(_INPUT):
            token_embd += n
        else:
            output += n
    return AdapterBytes(tuple(layers), token_embd, output)


def with_adapters(est: MemoryEstimate, adapters: Sequence[AdapterBytes]) -> MemoryEstimate:
    """``est`` with the adapters' bytes folded into the parts they live with (the layers, the
    input and the output parts), so that placement moves them with their layers.
    ``est.adapters`` (bytes with no known place, put on the first GPU) is left as it is."""
    if not adapters:
        return est
    layers = list(est.layers)
    token_embd, output = est.token_embd, est.output
    for a in adapters:
        if len(a.layers) != len(layers):
            raise ValueError(f"an adapter for {len(a.layers)} layers on a model of {len(layers)}")
        layers = [x + y for x, y in zip(layers, a.layers, strict=True)]
        token_embd += a.token_embd
        output += a.output
    added = sum(sum(a.layers) for a in adapters)
    return replace(est, layers=tuple(layers), weights=est.weights + added, token_embd=token_embd, output=output)
