"""Whether a draft model can draft for a target: their vocabularies compared as llama.cpp does.

llama-server b10068 (``common_speculative_are_compatible``) refuses a draft model whose
vocabulary differs from the target's, and then serves **without** speculation, saying so only in
its log. trioshed checks first, with llama.cpp's rules, so that a wrong ``draft`` in
``models.toml`` is a clear error instead of a silent slowdown:

* the same tokenizer model (``tokenizer.ggml.model``: ``llama``, ``gpt2``, …);
* the same "add BOS" and "add EOS" flags, and the same BOS / EOS ids where they are added;
* vocabulary sizes within :data:`MAX_SIZE_DIFFERENCE` tokens;
* the same text for every token from id :data:`CHECK_START` up to the smaller vocabulary's end.

The token texts are read from the file on demand (the header reader steps over them): gemma3's
262,144 tokens take ~0.3 s, so the answer is cached by both files' identity.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any

from trioshed.models.gguf_meta import ArrayInfo, read_metadata

MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
CHECK_START = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
_U64 = struct.Struct("<Q")


def read_tokens(path: str, info: ArrayInfo) -> list[bytes]:
    """The ``tokenizer.ggml.tokens`` strings of ``path`` (``info`` from its header)."""
    out: list[bytes] = []
    with open(path, "rb", buffering=1 << 20) as f:
        f.seek(info.offset)
        read = f.read
        for _ in range(info.length):
            head = read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated vocabulary")
            out.append(read(_U64.unpack(head)[0]))
    return out


def _tokens(path: str, meta: Any) -> list[bytes]:
    value = meta.fields.get("tokenizer.ggml.tokens")
    if isinstance(value, ArrayInfo):
        return read_tokens(path, value)
    if isinstance(value, tuple):  # a small vocabulary, decoded with the header
        return [v.encode() if isinstance(v, str) else bytes(v) for v in value]
    return []


def incompatibility(target: str, draft: str) -> str:
    """Why ``draft`` cannot draft for ``target`` (GGUF paths), or "" when it can."""
    st_t, st_d = os.stat(target), os.stat(draft)
    return _incompatibility(target, st_t.st_mtime_ns, st_t.st_size, draft, st_d.st_mtime_ns, st_d.st_size)


@functools.lru_cache(maxsize=32)
def _incompatibility(target: str, _t_mtime: int, _t_size: int, draft: str, _d_mtime: int, _d_size: int) -> str:
    mt, md = read_metadata(target), read_metadata(draft)

    def get(meta: Any, key: str, default: object = None) -> object:
        return meta.fields.get(key, default)

    kind_t, kind_d = get(mt, "tokenizer.ggml.model"), get(md, "tokenizer.ggml.model")
    if kind_t != kind_d:
        return f"its tokenizer is {kind_d!r}, the target's is {kind_t!r}"
    for which in ("bos", "eos"):
        default_add = which == "bos" and kind_t == "llama"  # llama.cpp's defaults for SentencePiece
        add_t = bool(get(mt, f"tokenizer.ggml.add_{which}_token", default_add))
        add_d = bool(get(md, f"tokenizer.ggml.add_{which}_token", default_add))
        id_t, id_d = get(mt, f"tokenizer.ggml.{which}_token_id"), get(md, f"tokenizer.ggml.{which}_token_id")
        if add_t != add_d or (add_t and id_t != id_d):
            return (f"its {which.upper()} token differs (added: {add_d}, id {id_d}; the target's: added: "
                    f"{add_t}, id {id_t})")  # fmt: skip
    tokens_t, tokens_d = _tokens(target, mt), _tokens(draft, md)
    if abs(len(tokens_t) - len(tokens_d)) > MAX_SIZE_DIFFERENCE:
        return (f"its vocabulary has {len(tokens_d)} tokens, the target's {len(tokens_t)} "
                f"(llama.cpp allows a difference of {MAX_SIZE_DIFFERENCE})")  # fmt: skip
    for i in range(CHECK_START, min(len(tokens_t), len(tokens_d))):
        if tokens_t[i] != tokens_d[i]:
            return (f"token {i} is {tokens_d[i].decode('utf-8', 'replace')!r}, the target's is "
                    f"{tokens_t[i].decode('utf-8', 'replace')!r}")  # fmt: skip
    return ""
