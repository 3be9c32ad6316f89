"""Which GGUF files of a folder are multimodal projectors, and which model each one belongs to.

A projector (``--mmproj``: a ``clip`` GGUF holding a vision or audio encoder) is never a model of
its own: llama-server cannot load it as one. A folder store pairs a projector with its model
without configuration where the pairing is unambiguous, by the rules people already follow:

* **llama.cpp's router** (``llama-server --models-dir``) reads a sub-folder as one model, named
  after the folder, whose file with ``mmproj`` in its name is the projector; a top-level file
  with ``mmproj`` in its name is a companion, never a model. The same here: a file is a projector
  when its name holds ``mmproj`` (or its header says ``clip``, checked by the store).
* **A folder holding one model and one projector** (the store folder itself, or a sub-folder):
  they go together, whatever their names.
* **Hugging Face's naming** beside several models: a projector goes with the models whose name
  it shares once ``mmproj`` and the quantization are taken off both
  (``mmproj-gemma-3-4b-it-f16.gguf`` with ``gemma-3-4b-it-Q4_K_M.gguf`` and
  ``gemma-3-4b-it-Q8_0.gguf``; ``Qwen2.5-VL-7B-Instruct-mmproj-f16.gguf`` likewise).

Anything else is ambiguous and never guessed: a model that two projectors' names match, or a
folder of several models whose projectors name none of them. Such a model is served without a
projector and the reason is kept (:attr:`FolderPairing.ambiguous`) for the log and ``/api/show``;
``models.toml``'s ``projector =`` settles it (and always wins). Pure: names in, pairing out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["FolderPairing", "is_projector_name", "pair_folder"]

# A trailing quantization or precision: "-Q4_K_M", "-f16", ".BF16", "-UD-Q4_K_XL", "-IQ3_XXS".
_QUANT = re.compile(
    r"[-_.](?:f16|f32|bf16|fp16|fp32|ud|mxfp4|q\d+(?:_[a-z0-9]+)*|iq\d+(?:_[a-z0-9]+)*|tq\d+(?:_\d+)?)$"
)
_MMPROJ = re.compile(r"[-_.]?mmproj(?:[-_.]model)?[-_.]?")


def is_projector_name(file_name: str) -> bool:
    """Whether a GGUF file's name marks it a projector (llama.cpp's rule: ``mmproj`` in it)."""
    return "mmproj" in file_name.lower()


def _stem(file_name: str) -> str:
    return file_name[: -len(".gguf")] if file_name.lower().endswith(".gguf") else file_name


def _base(stem: str) -> str:
    """A name without its trailing quantization tokens, lower-case."""
    out = stem.lower()
    while (m := _QUANT.search(out)) is not None and m.start() > 0:
        out = out[: m.start()]
    return out


def _projector_base(file_name: str) -> str:
    """What a projector's name says of its model: ``mmproj`` and the quantization taken off
    (empty for a generic ``mmproj-f16.gguf``)."""
    return _base(_MMPROJ.sub("-", _stem(file_name).lower()).strip("-_."))


@dataclass(frozen=True)
class FolderPairing:
    """The projectors of one folder and the models they go with (file names, not paths)."""

    projectors: frozenset[str] = frozenset()
    #: model file name -> projector file name
    paired: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: model file name -> why no projector was chosen for it
    ambiguous: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def pair_folder(names: Iterable[str], *, projectors: Iterable[str] = ()) -> FolderPairing:
    """Pair the ``*.gguf`` file ``names`` of one folder. ``projectors``: more names known to be
    projectors (by their header) although their name does not say so."""
    files = sorted({n for n in names if n.lower().endswith(".gguf")})
    known = set(projectors)
    found = frozenset(n for n in files if is_projector_name(n) or n in known)
    models = [n for n in files if n not in found]
    if not found or not models:
        return FolderPairing(found)
    if len(models) == 1 and len(found) == 1:
        return FolderPairing(found, MappingProxyType({models[0]: next(iter(found))}))
    by_base: dict[str, list[str]] = {}
    for projector in sorted(found):
        if base := _projector_base(projector):
            by_base.setdefault(base, []).append(projector)
    paired: dict[str, str] = {}
    ambiguous: dict[str, str] = {}
    used: set[str] = set()
    for model in models:
        stem = _stem(model).lower()
        matches = by_base.get(_base(stem)) or by_base.get(stem) or []
        if len(matches) == 1:
            paired[model] = matches[0]
            used.add(matches[0])
        elif matches:
            ambiguous[model] = f"several projectors match its name: {', '.join(matches)}"
            used.update(matches)
    unnamed = sorted(found - used)
    if unnamed:
        for model in models:
            if model not in paired and model not in ambiguous:
                ambiguous[model] = (
                    f"the folder holds {len(models)} model{'s' if len(models) > 1 else ''} and projectors whose names match none "
                    f"({', '.join(unnamed)})"
                )
    return FolderPairing(found, MappingProxyType(paired), MappingProxyType(ambiguous))


def first_architecture(path: str) -> str | None:
    """The ``general.architecture`` of a GGUF file when it is the file's first key (as llama.cpp's
    converters and the ``gguf`` package write it), read from its first few hundred bytes; None
    when the file does not say so there. Blocking (one small read): lets a folder of thousands of
    models tell projectors from models without parsing whole headers."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    if len(head) < 32 or head[:4] != b"GGUF" or int.from_bytes(head[4:8], "little") < 2:
        return None
    at = 24  # magic, version, tensor count, key count
    key_len = int.from_bytes(head[at : at + 8], "little")
    at += 8
    if head[at : at + key_len] != b"general.architecture":
        return None
    at += key_len
    if int.from_bytes(head[at : at + 4], "little") != 8:  # GGUF_TYPE_STRING
        return None
    value_len = int.from_bytes(head[at + 4 : at + 12], "little")
    value = head[at + 12 : at + 12 + value_len]
    return value.decode("utf-8", "replace") if len(value) == value_len and value_len < 64 else None
