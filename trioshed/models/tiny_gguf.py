"""Write tiny random-weight llama-architecture GGUF files that ``llama-server`` loads in milliseconds.

Provisioning proves that a ``llama-server`` build runs on this CPU by loading one (a build can
print ``--version`` and still die with SIGILL while loading a model), and the tests and benchmarks
start real ``llama-server`` children over them (``trioshed.testing.tiny`` adds their shapes and a
LoRA adapter). A 64-wide, 2-layer llama with a 132-token vocabulary loads in tens of milliseconds
and streams tokens as fast as the HTTP path can carry them; the only real model at hand
(gemma3-270m) takes seconds to start.

The vocabulary is a SentencePiece (``llama``) one that llama.cpp accepts: ``<unk>``, ``<s>``,
``</s>``, the byte tokens ``<0x00>``..``<0x7F>`` (bytes >= 0x80 would make random output invalid
UTF-8, which llama-server rejects) and a ``▁`` piece (without it tokenizing fails with
``_Map_base::at``). A chatml-style ``tokenizer.chat_template`` makes the chat endpoints work.
With ``fim`` three control tokens follow (``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``,
:data:`FIM_IDS`) and the ``tokenizer.ggml.fim_*_token_id`` keys name them: what llama-server's
``/infill`` needs (and what makes ``/api/show`` list ``insert``).

Random models emit ``</s>`` about once in 150 tokens. With ``low_eos`` the model is built so that
``</s>`` never wins: hidden dimension 0 is a constant 1.0 written by the token embedding and never
touched by the layers (row 0 of every ``attn_output`` and ``ffn_down`` is zero), so after the final
RMS norm it is positive; ``</s>``'s row of ``output.weight`` is ``-EOS_PENALTY`` in that dimension
and zero elsewhere, while no other row reads dimension 0. Its logit is therefore about
``-EOS_PENALTY`` whatever the input, and generations run to their token limit.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

#: Token ids of the special tokens, fixed by the vocabulary layout below.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
#: Token ids of the fill-in-the-middle tokens of a ``fim`` model (prefix, suffix, middle).
FIM_IDS = (132, 133, 134)
FIM_TOKENS = (b"<fim_prefix>", b"<fim_suffix>", b"<fim_middle>")
#: ``</s>``'s logit is about minus this with ``low_eos``.
EOS_PENALTY = 100.0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WEIGHT_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def vocabulary(*, fim: bool = False) -> tuple[list[bytes], list[float], list[int]]:
    """The tokens, scores and token types of the tiny SentencePiece vocabulary (132 entries, 135
    with the ``fim`` tokens)."""
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(0x80):
        tokens.append(f"<0x{byte:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
    tokens.append("\u2581".encode())
    types.append(gguf.TokenType.NORMAL)
    scores = [0.0] * len(tokens)
    scores[-1] = -1.0
    if fim:
        tokens.extend(FIM_TOKENS)
        types.extend([gguf.TokenType.CONTROL] * len(FIM_TOKENS))
        scores.extend([0.0] * len(FIM_TOKENS))
    return tokens, scores, [int(t) for t in types]


def add_vocabulary(writer: gguf.GGUFWriter, tokens: list[bytes], scores: list[float], types: list[int]) -> None:
    """A SentencePiece ("llama") tokenizer with ``<unk>``, ``<s>`` and ``</s>`` first: BOS added, EOS not."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int | None = None,
    context_length: int = 2048,
    seed: int = 0,
    name: str = "tiny",
    low_eos: bool = True,
    weight_type: str = "F32",
    tied_embeddings: bool = False,
    pooling_type: int | None = None,
    chat_template: str = CHATML_TEMPLATE,
    fim: bool = False,
) -> Path:
    """Write a random-weight llama GGUF to ``path`` (atomically: temporary file, then rename).

    ``n_head_kv`` defaults to ``n_head`` (no GQA), ``n_ff`` to ``2 * n_embd``. ``weight_type`` is
    ``"F32"``, ``"F16"`` or ``"Q8_0"`` for the 2-D matrices (norms stay F32; Q8_0 needs widths that
    are multiples of 32). ``tied_embeddings`` omits ``output.weight`` so llama.cpp reuses
    ``token_embd.weight`` as the output projection, as gemma3 does. The same arguments and seed
    always give the same bytes. ``pooling_type`` sets ``llama.pooling_type``, which marks an
    embedding model (1 = mean). ``chat_template`` is the template llama-server applies (ChatML by
    default; the tests' ``TOOLS_TEMPLATE`` for one with tools; ``""`` for none: a base model).
    ``fim`` adds the fill-in-the-middle tokens (:data:`FIM_IDS`).
    """
    n_head_kv = n_head if n_head_kv is None else n_head_kv
    n_ff = 2 * n_embd if n_ff is None else n_ff
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(
            f"n_embd {n_embd} must divide by n_head {n_head}, n_head by n_head_kv {n_head_kv}"
        )
    if weight_type not in _WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {sorted(_WEIGHT_TYPES)}, not {weight_type!r}")
    head_dim = n_embd // n_head
    tokens, scores, types = vocabulary(fim=fim)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    # numpy shapes are (rows, cols) = ggml's {ne0 = cols, ne1 = rows} reversed.
    embd = normal(n_vocab, n_embd, std=1.0)
    output = normal(n_vocab, n_embd, std=1.0)
    if low_eos:
        embd[:, 0] = 1.0  # the constant, positive hidden dimension
        output[:, 0] = 0.0
        output[EOS_ID, :] = 0.0
        output[EOS_ID, 0] = -EOS_PENALTY
        if tied_embeddings:
            # token_embd doubles as the output matrix; its column 0 is read for every logit, which
            # shifts all logits alike (harmless) except </s>'s.
            embd[EOS_ID, :] = 0.0
            embd[EOS_ID, 0] = -EOS_PENALTY

    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", embd)]
    for i in range(n_layer):
        wo = normal(n_embd, n_head * head_dim, std=0.5 / np.sqrt(n_embd))
        down = normal(n_embd, n_ff, std=0.5 / np.sqrt(n_ff))
        if low_eos:
            wo[0, :] = 0.0
            down[0, :] = 0.0
        tensors += [
            (f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32)),
            (
                f"blk.{i}.attn_q.weight",
                normal(n_head * head_dim, n_embd, std=1.0 / np.sqrt(n_embd)),
            ),
            (
                f"blk.{i}.attn_k.weight",
                normal(n_head_kv * head_dim, n_embd, std=1.0 / np.sqrt(n_embd)),
            ),
            (
                f"blk.{i}.attn_v.weight",
                normal(n_head_kv * head_dim, n_embd, std=1.0 / np.sqrt(n_embd)),
            ),
            (f"blk.{i}.attn_output.weight", wo),
            (f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32)),
            (f"blk.{i}.ffn_gate.weight", normal(n_ff, n_embd, std=1.0 / np.sqrt(n_embd))),
            (f"blk.{i}.ffn_up.weight", normal(n_ff, n_embd, std=1.0 / np.sqrt(n_embd))),
            (f"blk.{i}.ffn_down.weight", down),
        ]
    tensors.append(("output_norm.weight", np.ones(n_embd, np.float32)))
    if not tied_embeddings:
        tensors.append(("output.weight", output))

    target = Path(path)
    with gguf_written_atomically(target) as writer:
        writer.add_name(name)
        writer.add_file_type(_FILE_TYPES[weight_type])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(context_length)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(n_vocab)
        add_vocabulary(writer, tokens, scores, types)
        if chat_template:
            writer.add_chat_template(chat_template)
        if fim:
            for key, token_id in zip((gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID, gguf.Keys.Tokenizer.FIM_MID_ID), FIM_IDS, strict=True):
                writer.add_uint32(key, token_id)
        if pooling_type is not None:
            writer.add_pooling_type(gguf.PoolingType(pooling_type))
        for tensor_name, data in tensors:
            if data.ndim == 1 or weight_type == "F32":
                writer.add_tensor(tensor_name, data)
            elif weight_type == "F16":
                writer.add_tensor(tensor_name, data.astype(np.float16))
            else:
                qtype = _WEIGHT_TYPES[weight_type]
                writer.add_tensor(tensor_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    return target


@contextmanager
def gguf_written_atomically(target: Path, arch: str = "llama") -> Iterator[gguf.GGUFWriter]:
    """A GGUF writer (``general.architecture`` ``arch``) whose file appears at ``target`` whole
    or not at all: written to a temporary file beside it, renamed over ``target`` once the block
    has added everything."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp_name, arch)
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
