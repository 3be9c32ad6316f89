"""What a model can do, as ``/api/show`` reports it (``capabilities``), decided as Ollama does.

Pure: takes the GGUF key-values, the prompt template and whether a projector comes with it.

* ``embedding`` when the GGUF sets ``<arch>.pooling_type`` (an embedding model), ``completion``
  otherwise (clients such as ``llm-ollama`` refuse to embed with a model lacking ``embedding``);
* ``vision`` when the GGUF has a vision tower (``<arch>.vision.block_count``) or a projector is
  present;
* ``tools`` when the template uses tools, ``insert`` when it uses a suffix (Ollama templates'
  ``.Suffix``) or the vocabulary has fill-in-the-middle tokens (what llama-server's /infill needs);
* ``thinking`` when the template has a thinking block (``<think>``, ``reasoning_content``,
  ``enable_thinking``) or the family is gpt-oss.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_TOOLS = re.compile(r"\btools\b", re.IGNORECASE)
_SUFFIX = re.compile(r"\.Suffix\b")
_THINKING = re.compile(r"<think>|reasoning_content|enable_thinking|\.Thinking\b")
_FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")


def capabilities(fields: Mapping[str, Any], template: str, *, projector: bool = False, family: str = "") -> list[str]:
    arch = str(fields.get("general.architecture", ""))
    found = ["embedding" if f"{arch}.pooling_type" in fields else "completion"]
    if f"{arch}.vision.block_count" in fields or projector:
        found.append("vision")
    if _TOOLS.search(template):
        found.append("tools")
    if _SUFFIX.search(template) or any(key in fields for key in _FIM_KEYS):
        found.append("insert")
    if _THINKING.search(template) or family.lower() in ("gptoss", "gpt-oss") or arch == "gptoss":
        found.append("thinking")
    return found
