"""Tiny random-weight multimodal projectors for :func:`~trioshed.models.tiny_gguf.write_tiny_model`,
and the small images and sounds that tests send to them.

A projector is a GGUF of architecture ``clip`` that ``llama-server --mmproj`` loads beside the
language model; llama.cpp's multimodal library (``tools/mtmd``) encodes each image or audio clip
with it into embeddings of the language model's width (``projection_dim``, 64 for the tiny model)
and decodes them as if they were tokens. Two kinds are written here, both loading in milliseconds
with the pinned ``llama-server``:

* :func:`write_tiny_vision_projector`: a ``gemma3`` projector (a 2-layer SigLIP-style encoder, 32
  wide, on 32x32 images cut into 4x4 patches, average-pooled 4x4 into :data:`IMAGE_TOKENS` tokens,
  then RMS-normed and projected), about 94 KB. Every image becomes :data:`IMAGE_TOKENS` tokens
  between the text markers ``<start_of_image>`` and ``<end_of_image>``.
* :func:`write_tiny_audio_projector`: a ``qwen2a`` projector (a 1-layer Whisper-style encoder, 16
  wide, over 128 mel bins, then a linear projection), about 139 KB; most of it is the encoder's
  1,500 positions. llama.cpp cuts audio into 30-second chunks of :data:`AUDIO_CHUNK_TOKENS`
  tokens each, so a model that hears needs a context of a couple of thousand tokens.

The same arguments and seed always give the same bytes.
"""

from __future__ import annotations

import io
import os
import struct
import wave
import zlib
from pathlib import Path

import numpy as np

from trioshed.models.tiny_gguf import gguf_written_atomically

__all__ = [
    "AUDIO_CHUNK_TOKENS",
    "IMAGE_TOKENS",
    "tiny_png",
    "tiny_wav",
    "write_tiny_audio_projector",
    "write_tiny_vision_projector",
]

#: Tokens one image takes with the tiny vision projector ((32 / 4 patches / 4 pooled) squared).
IMAGE_TOKENS = 4
#: Tokens one 30-second audio chunk takes with the tiny audio projector (3,000 mel frames, halved
#: by the encoder's strided convolution and again by the projector's pooling).
AUDIO_CHUNK_TOKENS = 750


def _normal(rng: np.random.Generator, *shape: int, std: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _encoder_block(rng: np.random.Generator, prefix: str, i: int, n_embd: int, n_ff: int, *, k_bias: bool) -> list[tuple[str, np.ndarray]]:
    """One pre-norm transformer block of a ``clip`` encoder (numpy shapes are ggml's reversed)."""
    out: list[tuple[str, np.ndarray]] = []
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        out.append((f"{prefix}.blk.{i}.{name}.weight", _normal(rng, n_embd, n_embd, std=1.0 / np.sqrt(n_embd))))
        if name != "attn_k" or k_bias:
            out.append((f"{prefix}.blk.{i}.{name}.bias", _normal(rng, n_embd)))
    for norm in ("ln1", "ln2"):
        out += [(f"{prefix}.blk.{i}.{norm}.weight", np.ones(n_embd, np.float32)), (f"{prefix}.blk.{i}.{norm}.bias", _normal(rng, n_embd))]
    out += [
        (f"{prefix}.blk.{i}.ffn_up.weight", _normal(rng, n_ff, n_embd, std=1.0 / np.sqrt(n_embd))),
        (f"{prefix}.blk.{i}.ffn_up.bias", _normal(rng, n_ff)),
        (f"{prefix}.blk.{i}.ffn_down.weight", _normal(rng, n_embd, n_ff, std=1.0 / np.sqrt(n_ff))),
        (f"{prefix}.blk.{i}.ffn_down.bias", _normal(rng, n_embd)),
    ]
    return out


def write_tiny_vision_projector(path: str | os.PathLike[str], *, text_embd: int = 64, seed: int = 0, name: str = "tiny-vision") -> Path:
    """Write a random ``gemma3`` vision projector for a language model ``text_embd`` wide."""
    n_embd, n_ff, n_layer, image_size, patch = 32, 64, 2, 32, 4
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, np.ndarray]] = [
        ("v.patch_embd.weight", _normal(rng, n_embd, 3, patch, patch)),
        ("v.patch_embd.bias", _normal(rng, n_embd)),
        ("v.position_embd.weight", _normal(rng, (image_size // patch) ** 2, n_embd)),
    ]
    for i in range(n_layer):
        tensors += _encoder_block(rng, "v", i, n_embd, n_ff, k_bias=True)
    tensors += [
        ("v.post_ln.weight", np.ones(n_embd, np.float32)),
        ("v.post_ln.bias", _normal(rng, n_embd)),
        ("mm.input_projection.weight", _normal(rng, n_embd, text_embd, std=1.0)),
        ("mm.soft_emb_norm.weight", np.ones(n_embd, np.float32)),
    ]
    target = Path(path)
    with gguf_written_atomically(target, "clip") as writer:
        writer.add_name(name)
        writer.add_file_type(0)
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_string("clip.projector_type", "gemma3")
        writer.add_bool("clip.use_gelu", True)
        writer.add_uint32("clip.vision.image_size", image_size)
        writer.add_uint32("clip.vision.patch_size", patch)
        writer.add_uint32("clip.vision.embedding_length", n_embd)
        writer.add_uint32("clip.vision.feed_forward_length", n_ff)
        writer.add_uint32("clip.vision.block_count", n_layer)
        writer.add_uint32("clip.vision.attention.head_count", 4)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        writer.add_uint32("clip.vision.projection_dim", text_embd)
        writer.add_uint32("clip.vision.projector.scale_factor", 4)
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        for tensor_name, data in tensors:
            writer.add_tensor(tensor_name, data)
    return target


def write_tiny_audio_projector(path: str | os.PathLike[str], *, text_embd: int = 64, seed: int = 1, name: str = "tiny-audio") -> Path:
    """Write a random ``qwen2a`` (Whisper encoder) audio projector for a language model
    ``text_embd`` wide."""
    n_embd, n_ff, n_mel, n_pos = 16, 32, 128, 1500
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, np.ndarray]] = [
        ("a.conv1d.1.weight", _normal(rng, n_embd, n_mel, 3)),
        ("a.conv1d.1.bias", _normal(rng, n_embd, 1)),  # {1, n_embd}: added across frames
        ("a.conv1d.2.weight", _normal(rng, n_embd, n_embd, 3)),
        ("a.conv1d.2.bias", _normal(rng, n_embd, 1)),
        ("a.position_embd.weight", _normal(rng, n_pos, n_embd)),
    ]
    tensors += _encoder_block(rng, "a", 0, n_embd, n_ff, k_bias=False)
    tensors += [
        ("a.post_ln.weight", np.ones(n_embd, np.float32)),
        ("a.post_ln.bias", _normal(rng, n_embd)),
        ("mm.a.fc.weight", _normal(rng, text_embd, n_embd, std=1.0)),
        ("mm.a.fc.bias", _normal(rng, text_embd)),
    ]
    target = Path(path)
    with gguf_written_atomically(target, "clip") as writer:
        writer.add_name(name)
        writer.add_file_type(0)
        writer.add_bool("clip.has_audio_encoder", True)
        writer.add_string("clip.projector_type", "qwen2a")
        writer.add_bool("clip.use_gelu", True)
        writer.add_uint32("clip.audio.embedding_length", n_embd)
        writer.add_uint32("clip.audio.feed_forward_length", n_ff)
        writer.add_uint32("clip.audio.block_count", 1)
        writer.add_uint32("clip.audio.attention.head_count", 2)
        writer.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        writer.add_uint32("clip.audio.projection_dim", text_embd)
        writer.add_uint32("clip.audio.num_mel_bins", n_mel)
        for tensor_name, data in tensors:
            writer.add_tensor(tensor_name, data)
    return target


def tiny_png(width: int = 40, height: int = 30, *, seed: int = 0) -> bytes:
    """A PNG of random RGB pixels (8-bit, no filter), written without an imaging library."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def tiny_wav(seconds: float = 1.0, *, frequency: float = 440.0, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV of a sine tone."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * frequency * t) * 8000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()
