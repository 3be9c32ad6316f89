"""What a model can do, as ``/api/show`` reports it (``capabilities``), decided as Ollama does.

Pure: takes the GGUF key-values, the prompt template and whether a projector comes with it.

* ``rerank`` for a reranker (:func:`is_reranker`: rank pooling or a classifier head), else
  ``embedding`` when the GGUF sets ``<arch>.pooling_type`` (an embedding model), ``completion``
  otherwise (clients such as ``llm-ollama`` refuse to embed with a model lacking ``embedding``);
* ``vision`` when the GGUF has a vision tower (``<arch>.vision.block_count``) or a projector
  with a vision encoder (``clip.has_vision_encoder``; any projector when its header is not
  given); ``audio`` likewise for an audio encoder (``clip.has_audio_encoder``), as Ollama adds it;
* ``tools`` when the template uses tools, ``insert`` when it uses a suffix (Ollama templates'
  ``.Suffix``) or the vocabulary has fill-in-the-middle tokens (what llama-server's /infill needs);
* ``thinking`` when the template has a thinking block (``<think>``, ``reasoning_content``,
  ``enable_thinking``) or the family is gpt-oss.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_TOOLS = re.compile(r"\btools\b", re.IGNORECASE)
_SUFFIX = re.compile(r"\.Suffix\b")
_THINKING = re.compile(r"<think>|reasoning_content|enable_thinking|\.Thinking\b")
_FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")


#: llama.cpp's ``enum llama_pooling_type`` values as ``<arch>.pooling_type`` stores them.
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
RANK_POOLING = 4
#: Classifier-head tensors of a cross-encoder (BERT-style rerankers: ``cls.weight``,
#: ``cls.output.weight``), which llama.cpp's rank pooling applies.
_CLASSIFIER_PREFIX = "cls."


def pooling_type(fields: Mapping[str, Any]) -> int | None:
    """The GGUF's own ``<arch>.pooling_type`` (see :data:`POOLING_NAMES`), None when unset."""
    arch = str(fields.get("general.architecture", ""))
    value = fields.get(f"{arch}.pooling_type")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def is_reranker(fields: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> bool:
    """A cross-encoder: rank pooling in the GGUF, or a classifier head (``cls.*`` tensors)."""
    if pooling_type(fields) == RANK_POOLING:
        return True
    return any(name.startswith(_CLASSIFIER_PREFIX) for name in tensor_names)


def generates(fields: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> bool:
    """Whether the model writes text: neither a reranker nor a model with a pooling of its own
    (an embedding model such as BERT)."""
    arch = str(fields.get("general.architecture", ""))
    return not is_reranker(fields, tensor_names) and f"{arch}.pooling_type" not in fields


def capabilities(
    fields: Mapping[str, Any],
    template: str,
    *,
    projector: bool = False,
    projector_fields: Mapping[str, Any] | None = None,
    family: str = "",
    tensor_names: Iterable[str] = (),
) -> list[str]:
    arch = str(fields.get("general.architecture", ""))
    names = tuple(tensor_names)
    if is_reranker(fields, names):
        found = ["rerank"]
    else:
        found = ["completion" if generates(fields, names) else "embedding"]
    sees = projector_fields is None or bool(projector_fields.get("clip.has_vision_encoder"))
    if f"{arch}.vision.block_count" in fields or (projector and sees):
        found.append("vision")
    if f"{arch}.audio.block_count" in fields or (projector and projector_fields and projector_fields.get("clip.has_audio_encoder")):
        found.append("audio")
    if _TOOLS.search(template):
        found.append("tools")
    if _SUFFIX.search(template) or any(key in fields for key in _FIM_KEYS):
        found.append("insert")
    if _THINKING.search(template) or family.lower() in ("gptoss", "gpt-oss") or arch == "gptoss":
        found.append("thinking")
    return found
