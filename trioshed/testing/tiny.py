"""Tiny GGUF models for tests and benchmarks: the writer (:mod:`trioshed.models.tiny_gguf`, which
provisioning uses too) with what only tests need beside it: a few distinct shapes
(:func:`tiny_model_shapes`), a chatml template with tools (:data:`TOOLS_TEMPLATE`) and a LoRA
adapter for the default shape (:func:`write_tiny_lora`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trioshed.models.tiny_gguf import (
    BOS_ID,
    CHATML_TEMPLATE,
    EOS_ID,
    EOS_PENALTY,
    FIM_IDS,
    FIM_TOKENS,
    UNK_ID,
    gguf_written_atomically,
    vocabulary,
    write_tiny_model,
)

__all__ = [
    "BOS_ID",
    "CHATML_TEMPLATE",
    "EOS_ID",
    "EOS_PENALTY",
    "FIM_IDS",
    "FIM_TOKENS",
    "TOOLS_TEMPLATE",
    "UNK_ID",
    "TinyShape",
    "tiny_model_shapes",
    "vocabulary",
    "write_tiny_lora",
    "write_tiny_model",
]

#: A chatml template that offers tools and renders tool calls and results the way llama-server's
#: template analysis recognizes (``<tool_call>`` JSON), so that its chat answers carry parsed
#: ``tool_calls`` (a continued assistant message holding a call is parsed as one).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "Call a function with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant\n{% for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Keyword arguments for :func:`write_tiny_model`, named for test ids."""

    name: str
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int | None = None
    n_ff: int | None = None
    context_length: int = 2048
    weight_type: str = "F32"
    tied_embeddings: bool = False

    def kwargs(self) -> dict[str, object]:
        """The arguments to pass to :func:`write_tiny_model` (everything but the path)."""
        return {
            "name": self.name,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "n_ff": self.n_ff,
            "context_length": self.context_length,
            "weight_type": self.weight_type,
            "tied_embeddings": self.tied_embeddings,
        }


def tiny_model_shapes() -> tuple[TinyShape, ...]:
    """A few distinct shapes for tests that must not depend on one geometry.

    They differ in width, depth, grouped-query attention (``n_head_kv < n_head``), weight type and
    tied embeddings (no ``output.weight``), all of which change the memory estimate. Quantized KV
    caches (q8_0, q4_0) need a head width divisible by 32: every shape but ``tiny`` (16) has one.
    """
    return (
        TinyShape("tiny"),
        TinyShape("tiny-gqa", n_embd=128, n_layer=4, n_head=4, n_head_kv=2),
        TinyShape("tiny-deep-f16", n_embd=64, n_layer=6, n_head=4, n_head_kv=1, weight_type="F16"),
        TinyShape(
            "tiny-q8-tied",
            n_embd=256,
            n_layer=3,
            n_head=8,
            n_head_kv=4,
            weight_type="Q8_0",
            tied_embeddings=True,
        ),
    )


def write_tiny_lora(
    path: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, rank: int = 4, alpha: float = 8.0, seed: int = 1
) -> Path:
    """Write a random LoRA adapter (``general.type = adapter``) for :func:`write_tiny_model`'s
    default shape: ``lora_a``/``lora_b`` pairs for every layer's ``attn_q`` and ``ffn_up``, strong
    enough that a generation at temperature 0 changes. The same arguments give the same bytes."""
    rng = np.random.default_rng(seed)
    target = Path(path)
    with gguf_written_atomically(target) as writer:
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", alpha)
        n_ff = 2 * n_embd
        for i in range(n_layer):
            for tensor, n_out in (("attn_q", n_embd), ("ffn_up", n_ff)):
                # numpy (rows, cols) is ggml's {ne0 = cols, ne1 = rows}: a is {n_embd, rank}, b {rank, n_out}
                writer.add_tensor(f"blk.{i}.{tensor}.weight.lora_a", (rng.standard_normal((rank, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
                writer.add_tensor(f"blk.{i}.{tensor}.weight.lora_b", rng.standard_normal((n_out, rank)).astype(np.float32))
    return target
