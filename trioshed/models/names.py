"""Model names of the folder store and ``models.toml``: ``NAME[:TAG]``, checked so that no name
can escape the store folder.

Both the store (a file ``NAME.gguf`` is ``NAME:latest``) and the catalogue (entries, aliases,
drafts) spell and check names the same way, so the rule lives here, below both of them.
Ollama-style names (``[host/][namespace/]model[:tag]``) are
:func:`trioshed.models.ollama_store.parse_name`'s.
"""

from __future__ import annotations

import re

from trioshed.errors import BadRequest

MAX_NAME = 255  # a file name's limit on Linux filesystems
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_name_part(text: str) -> bool:
    """Whether ``text`` is a valid name or tag: letters, digits, ``.``, ``_`` and ``-``, starting
    with a letter or a digit (so a ``*.gguf`` file whose stem is not one is no model)."""
    return _PART.match(text) is not None


def split_name(name: str) -> tuple[str, str]:
    """``"gemma3-270m:latest"`` → ``("gemma3-270m", "latest")``; names that could escape → 400."""
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("model is required")
    if len(name) > MAX_NAME:
        raise BadRequest(f"invalid model name: {len(name)} characters, the limit is {MAX_NAME}")
    base, _, tag = name.strip().partition(":")
    tag = tag or "latest"
    if "/" in base or "\\" in base or ".." in base or not is_name_part(base) or not is_name_part(tag):
        raise BadRequest(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' with an optional ':tag'"
        )
    return base, tag


def full_name(name: str) -> str:
    """``"qwen"`` → ``"qwen:latest"``; raises BadRequest for a name the store would refuse."""
    base, tag = split_name(name)
    return f"{base}:{tag}"
