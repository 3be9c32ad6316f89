"""A name resolved before is given again while nothing its spec follows has changed, and every
change that would change the answer is seen at once: the file replaced or removed, a file added
to an earlier folder that now wins the name, a ``models.toml`` entry, a projector beside it, an
Ollama store appearing; and never from a version too recent to be told from a change in the
same clock tick (the filesystem's coarse timestamps)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trioshed.errors import ModelNotFound
from trioshed.models.resolved import SETTLED_NS
from trioshed.models.stores import Stores
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import write_tiny_vision_projector

OLD = time.time_ns() - 3600 * 10**9  # an hour ago: settled


def settle(*paths: Path) -> None:
    """Stamp ``paths`` an hour old (as a store that has not changed for a while)."""
    for path in paths:
        os.utime(path, ns=(OLD, OLD))


def stamp(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_tiny_model(second / "tiny.gguf")
    settle(second / "tiny.gguf", first, second)
    return first, second


def stores(first: Path, second: Path) -> Stores:
    return Stores(f"{first}{os.pathsep}{second}")


def test_a_settled_plain_file_is_resolved_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    spec = s.resolve("tiny")
    assert spec.path == str(second / "tiny.gguf")
    assert s.resolve("tiny") is spec  # kept: the same spec, not built again
    assert s.resolve("tiny:latest").path == spec.path


def test_a_replaced_file_is_seen_at_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    before = s.resolve("tiny")
    write_tiny_model(second / "tiny.gguf", n_layer=3)  # rewritten (a new size)
    settle(second / "tiny.gguf", second)
    after = s.resolve("tiny")
    assert after.size != before.size and after.size == (second / "tiny.gguf").stat().st_size


def test_a_removed_file_is_not_found(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    s.resolve("tiny")
    (second / "tiny.gguf").unlink()
    with pytest.raises(ModelNotFound):
        s.resolve("tiny")


def test_a_file_in_an_earlier_folder_wins_at_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    assert s.resolve("tiny").path == str(second / "tiny.gguf")
    write_tiny_model(first / "tiny.gguf")
    settle(first / "tiny.gguf")
    stamp(first, OLD + 10**9)  # the folder changed (an hour ago, still: only its stamp moved)
    assert s.resolve("tiny").path == str(first / "tiny.gguf")


def test_a_models_toml_entry_for_the_name_wins_at_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    s.resolve("tiny")
    (second / "models.toml").write_text('[models.tiny]\npath = "tiny.gguf"\noptions = { temperature = 0.25 }\n')
    settle(second / "models.toml")
    assert dict(s.resolve("tiny").defaults) == {"temperature": 0.25}


def test_a_projector_added_beside_the_model_is_paired_at_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    assert s.resolve("tiny").projector is None
    write_tiny_vision_projector(second / "mmproj.gguf")
    settle(second / "mmproj.gguf")
    stamp(second, OLD + 10**9)
    assert s.resolve("tiny").projector == str(second / "mmproj.gguf")


def test_an_ollama_store_appearing_in_a_folder_is_asked_at_once(folders: tuple[Path, Path]) -> None:
    first, second = folders
    s = stores(first, second)
    spec = s.resolve("tiny")
    (first / "manifests").mkdir()
    (first / "blobs").mkdir()
    assert s.resolve("tiny") is not spec  # looked up again (the first folder is an Ollama store now)
    assert s.resolve("tiny").path == spec.path  # which does not have it


def test_a_change_in_the_same_clock_tick_is_seen(tmp_path: Path) -> None:
    # Everything was just written: a projector added within the same tick of the folder's stamp
    # leaves that stamp as it was. The first lookup kept nothing, so the second sees it.
    write_tiny_model(tmp_path / "tiny.gguf")
    now = time.time_ns()
    stamp(tmp_path / "tiny.gguf", now - SETTLED_NS // 2)
    stamp(tmp_path, now)
    s = Stores(tmp_path)
    assert s.resolve("tiny").projector is None
    write_tiny_vision_projector(tmp_path / "mmproj.gguf")
    stamp(tmp_path, now)  # the same tick: the same stamp
    assert s.resolve("tiny").projector == str(tmp_path / "mmproj.gguf")
