"""Shared fixtures: model files, and the guarantee that no llama-server outlives the session."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from hypothesis import settings as hypothesis_settings

from tests.support.models import (  # noqa: F401
    gemma_model,
    gemma_model_path,
    tiny_model,
    tiny_models,
    tiny_shapes,
)
from tests.support.vulkan import vulkan_device, vulkan_shader_cache  # noqa: F401
from trioshed.testing.tiny import write_tiny_model

# Property tests are the same on every run of `make test`: derandomized (examples drawn from a
# fixed seed) and no example database to replay from. `make fuzz` searches with fresh seeds
# (--hypothesis-profile=fuzz); pin what it finds as an @example.
hypothesis_settings.register_profile("seeded", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("fuzz", derandomize=False, print_blob=True)
hypothesis_settings.load_profile("seeded")

# Every process started by this session inherits this marker: it finds leaked children even
# after they were re-parented.
SESSION_MARK = f"TRIOSHED_TEST_SESSION={uuid.uuid4().hex}"
os.environ["TRIOSHED_TEST_SESSION"] = SESSION_MARK.partition("=")[2]
# trioshed servers started as processes never write saved slots into the user's cache folder;
# tests of warm returns turn them on with a folder of their own.
os.environ["TRIOSHED_KV_CACHE_BUDGET"] = "0"


def session_llama_servers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if "llama-server" not in (proc.info["name"] or "") and not any(
                "llama-server" in part for part in (proc.info["cmdline"] or [])[:1]
            ):
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if SESSION_MARK.encode() in f.read().split(b"\0"):
                    found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_llama_server_outlives_the_session() -> Iterator[None]:
    yield
    left = session_llama_servers()
    for proc in left:
        proc.kill()
    assert not left, f"llama-server processes outlived the test session: {[p.pid for p in left]}"


@pytest.fixture
def no_leaked_runner() -> Iterator[None]:
    """Per test: every llama-server this test started is gone when it ends."""
    before = {p.pid for p in session_llama_servers()}
    yield
    left = [p for p in session_llama_servers() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"llama-server left running by this test: {[p.pid for p in left]}"


@pytest.fixture
def model_store(tmp_path: Path, tiny_model: Path) -> Path:  # noqa: F811
    """A store folder holding ``tiny.gguf`` (a hard link to the session's tiny model)."""
    store = tmp_path / "models"
    store.mkdir()
    os.link(tiny_model, store / "tiny.gguf")
    return store


def add_tiny(store: Path, name: str, **shape: object) -> Path:
    return write_tiny_model(store / f"{name}.gguf", **shape)  # type: ignore[arg-type]


@pytest.fixture
def unknown_arch_model(tmp_path: Path, tiny_model: Path) -> Path:  # noqa: F811
    """A well-formed GGUF of an architecture llama.cpp does not know ("llamb"): trioshed reads it,
    only llama-server refuses it."""
    data = tiny_model.read_bytes()
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    assert data[at : at + 5] == b"llama"
    bad = tmp_path / "unknown-arch.gguf"
    bad.write_bytes(data[:at] + b"llamb" + data[at + 5 :])
    return bad


@pytest.fixture
def gemma_store(tmp_path: Path, gemma_model: Path) -> Path:  # noqa: F811
    """A store folder naming the real cached ``gemma3-270m.gguf`` in its models.toml (a file
    outside the store is used only when models.toml names it)."""
    store = tmp_path / "gemma-store"
    store.mkdir()
    (store / "models.toml").write_text(f'[models."gemma3-270m"]\npath = {json.dumps(str(gemma_model))}\n')
    return store
