"""A tiny model that coding agents can drive: it reads their whole prompt and answers one line.

Claude Code, Codex CLI and opencode send 25-95 thousand tokens before the user's first word (a
system prompt, a dozen tool schemas, the environment), with non-ASCII text in it (``—``, ``✓``,
emoji). The random tiny models (:mod:`trioshed.models.tiny_gguf`) fail them three ways: their
128 byte tokens cannot spell a byte >= 0x80 (it becomes ``<unk>``), their context is 2,048
tokens, and they never end their turn, so an agent waits for the token limit and then retries.

:func:`write_agent_model` writes a model that does what an agent needs, by construction rather
than by training:

* **Every byte is a token**: the SentencePiece vocabulary holds ``<unk>``, ``<s>``, ``</s>``, the
  256 byte tokens ``<0x00>``..``<0xFF>`` and ``▁`` (a space), so any UTF-8 text tokenizes and
  counts one token per byte.
* **A long context that costs little**: a one-layer ``gemma3`` whose only layer is a
  sliding-window layer (a 256-token window; Gemma 3 makes five layers in six sliding). Attention
  then costs the window, not the prompt, per token, and llama.cpp keeps only the window's cache:
  a 95,000-token prompt is evaluated in about a second on one core and the runner holds about
  110 MB, where a one-layer llama with full attention took 305 s for the same prompt (its
  attention grows with the square of the prompt).
* **One answer, then the end of the turn**: the layer's output projections are zero, so the
  model is a bigram table: the next token depends on the current token only. After any token
  that is not part of :data:`AGENT_ANSWER` it says the answer's first token, after each answer
  token the next one, and after the last ``</s>``, with logit margins of 40 or more, so any
  sampler (temperature, top-k, top-p, min-p) picks the same tokens. A chat prompt ends with the
  template's generation prompt (``<|im_start|>assistant\\n``), whose last byte is no answer
  token, so every turn answers ``AGENT_ANSWER`` and stops (``finish_reason: "stop"``).

The chat template is the tiny models' ``TOOLS_TEMPLATE`` (ChatML with ``<tools>`` and
``<tool_call>``), which llama-server recognizes as a tool-calling format, so agents' tools are
offered through llama-server's grammar as with a real model. The model never calls a tool: its
answer never starts a ``<tool_call>``. The file is about 45 KB; the same arguments always give the
same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from trioshed.models.tiny_gguf import EOS_ID, add_vocabulary, gguf_written_atomically
from trioshed.testing.tiny import TOOLS_TEMPLATE

__all__ = ["AGENT_ANSWER", "AGENT_CONTEXT", "answer_tokens", "byte_vocabulary", "write_agent_model"]

#: What the agent model answers to every turn: ASCII, a space and a three-byte character, each
#: token once (the bigram chain needs distinct tokens).
AGENT_ANSWER = "Done ✓"
#: The context the model declares (``gemma3.context_length``): what trioshed sizes a runner up to.
AGENT_CONTEXT = 131072
#: The sliding window of its one layer.
WINDOW = 256
_SPACE_PIECE = "\u2581"
#: Logit scale: the chosen token leads every other by at least 40.
_MARGIN = 20.0


def byte_vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, ``▁``."""
    tokens = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
    tokens.append(_SPACE_PIECE.encode())
    types.append(gguf.TokenType.NORMAL)
    scores = [0.0] * len(tokens)
    scores[-1] = -1.0
    return tokens, scores, [int(t) for t in types]


def answer_tokens(answer: str) -> list[int]:
    """The token ids that spell ``answer`` in :func:`byte_vocabulary` (a space is ``▁``)."""
    space = 3 + 256
    ids: list[int] = []
    for char in answer:
        ids.extend([space] if char == " " else [3 + b for b in char.encode()])
    return ids


def write_agent_model(path: str | os.PathLike[str], *, answer: str = AGENT_ANSWER,
                      context_length: int = AGENT_CONTEXT, name: str = "agent") -> Path:
    """Write the agent model (see the module docstring) to ``path``, atomically.

    ``answer`` must spell each token once (no repeated byte, at most one space): ``ValueError``
    otherwise."""
    tokens, scores, types = byte_vocabulary()
    chain = answer_tokens(answer)
    if not chain or len(set(chain)) != len(chain):
        raise ValueError(f"the answer must be non-empty and use each byte once: {answer!r}")
    n_vocab, n_chain = len(tokens), len(chain)
    n_embd = 16 * ((n_chain + 1 + 15) // 16)  # dimension 0 is constant, 1..n mark answer tokens
    head_dim, n_ff = 4, 16

    embd = np.zeros((n_vocab, n_embd), np.float32)
    embd[:, 0] = 1.0
    output = np.zeros((n_vocab, n_embd), np.float32)
    output[chain[0], 0] = _MARGIN / 2  # any other token: start the answer
    for i, token in enumerate(chain):
        embd[token, 1 + i] = 1.0
        output[chain[0], 1 + i] = -_MARGIN  # ...but not in the middle of it
        output[chain[i + 1] if i + 1 < n_chain else EOS_ID, 1 + i] = _MARGIN

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    tensors = [
        ("token_embd.weight", embd),
        ("blk.0.attn_norm.weight", ones(n_embd)),
        ("blk.0.attn_q.weight", zeros(head_dim, n_embd)),
        ("blk.0.attn_k.weight", zeros(head_dim, n_embd)),
        ("blk.0.attn_v.weight", zeros(head_dim, n_embd)),
        ("blk.0.attn_q_norm.weight", ones(head_dim)),
        ("blk.0.attn_k_norm.weight", ones(head_dim)),
        ("blk.0.attn_output.weight", zeros(n_embd, head_dim)),
        ("blk.0.post_attention_norm.weight", ones(n_embd)),
        ("blk.0.ffn_norm.weight", ones(n_embd)),
        ("blk.0.ffn_gate.weight", zeros(n_ff, n_embd)),
        ("blk.0.ffn_up.weight", zeros(n_ff, n_embd)),
        ("blk.0.ffn_down.weight", zeros(n_embd, n_ff)),
        ("blk.0.post_ffw_norm.weight", ones(n_embd)),
        ("output_norm.weight", ones(n_embd)),
        ("output.weight", output),
    ]
    target = Path(path)
    with gguf_written_atomically(target, "gemma3") as writer:
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(context_length)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(1)
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(1)
        writer.add_head_count_kv(1)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_sliding_window(WINDOW)
        writer.add_vocab_size(n_vocab)
        add_vocabulary(writer, tokens, scores, types)
        writer.add_chat_template(TOOLS_TEMPLATE)
        for tensor_name, data in tensors:
            writer.add_tensor(tensor_name, data)
    return target
