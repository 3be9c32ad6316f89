"""What a multimodal projector (``--mmproj``) costs in memory: its weights and the compute buffer
llama.cpp's ``clip`` code reserves for encoding one image or one audio chunk.

The compute buffer is sized by the encoder's largest input: a whole image of ``image_size``
pixels (``n_pos`` patches), or a 30-second audio chunk (3,000 mel frames, ``n_pos`` = 1,500
after the strided convolution). It holds the input (and, for audio, the first convolution's
unfolded input in F16), a few activations per position, and the attention scores: one
``n_pos x n_pos`` matrix per head without flash attention, a few rows with it. Measured on
b10068 with the tiny projectors of ``trioshed.testing.vision``: vision 0.04 MiB with flash
attention and 0.11 without (this gives 0.07 and 0.11), audio 3.66 and 17.53 MiB (4.1 and 21.3);
on real SigLIP projectors the attention term dominates as it does there. An estimate that is a
little high is safe; the measured size replaces it once the runner reports it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["ProjectorHeader", "projector_compute", "projector_info", "projector_memory"]

#: Mel frames of one audio chunk (30 s at llama.cpp's 10 ms hop), before the strided convolution.
AUDIO_FRAMES = 3000


class ProjectorHeader(Protocol):
    """What is read from a projector's GGUF header (``GGUFMetadata`` provides it)."""

    @property
    def fields(self) -> Mapping[str, Any]: ...
    @property
    def tensors(self) -> Sequence[Any]: ...


def _u(fields: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = fields.get(key, default)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _encoder(fields: Mapping[str, Any], modality: str, n_pos: int, flash_attention: bool) -> int:
    n_embd = _u(fields, f"clip.{modality}.embedding_length")
    n_ff = _u(fields, f"clip.{modality}.feed_forward_length", 4 * n_embd)
    n_head = max(1, _u(fields, f"clip.{modality}.attention.head_count", 1))
    activations = n_pos * (3 * n_embd + n_ff) * 4
    attention = 2 * n_pos * n_embd * 4 if flash_attention else n_head * n_pos * n_pos * 4
    return activations + attention


def projector_compute(header: ProjectorHeader, *, flash_attention: bool) -> int:
    """Bytes of the compute buffers of a projector's encoders (vision and audio: a projector
    may hold both, each with its own context)."""
    fields = header.fields
    total = 0
    if fields.get("clip.has_vision_encoder"):
        image = _u(fields, "clip.vision.image_size", 224)
        patch = max(1, _u(fields, "clip.vision.patch_size", 14))
        n_pos = (image // patch) ** 2
        total += image * image * 3 * 4 + _encoder(fields, "vision", n_pos, flash_attention)
    if fields.get("clip.has_audio_encoder"):
        n_mel = _u(fields, "clip.audio.num_mel_bins", 128)
        n_pos = AUDIO_FRAMES // 2
        total += AUDIO_FRAMES * n_mel * 4 + AUDIO_FRAMES * n_mel * 3 * 2 + _encoder(fields, "audio", n_pos, flash_attention)
    return total


def projector_memory(header: ProjectorHeader, *, flash_attention: bool) -> int:
    """Weights plus compute buffers: what ``--mmproj`` adds to a runner."""
    weights = sum(int(t.nbytes) for t in header.tensors)
    return weights + projector_compute(header, flash_attention=flash_attention)


def projector_info(header: ProjectorHeader) -> dict[str, Any]:
    """The projector's header as Ollama's ``/api/show`` gives it (``projector_info``): every
    key-value, arrays of more than 5 items empty, and ``general.parameter_count``."""
    out: dict[str, Any] = {}
    for key, value in header.fields.items():
        if isinstance(value, list | tuple):
            out[key] = list(value) if len(value) <= 5 else []
        elif isinstance(value, bool | int | float | str):
            out[key] = value
        else:  # an array too long to decode
            out[key] = []
    out["general.parameter_count"] = sum(int(t.n_elements) for t in header.tensors)
    return out
