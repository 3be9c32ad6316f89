"""The demo model put into an empty store: the parts' concatenation, checked, written atomically."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from trioshed.models import demo


def parts(tmp_path: Path, *chunks: bytes) -> list[Path]:
    out = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / f"part{i}"
        path.write_bytes(chunk)
        out.append(path)
    return out


def test_concatenate_writes_the_parts_in_order(tmp_path: Path) -> None:
    chunks = [os.urandom(3 << 20), b"", os.urandom(12345)]
    target = tmp_path / "store" / "m.gguf"
    target.parent.mkdir()
    whole = b"".join(chunks)
    demo.concatenate(parts(tmp_path, *chunks), target, hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == whole
    assert list(target.parent.iterdir()) == [target]


def test_the_copy_without_copy_file_range_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> int:
        raise OSError(18, "Invalid cross-device link")  # EXDEV: what older kernels say across file systems

    monkeypatch.setattr(os, "copy_file_range", refuse)
    chunks = [os.urandom(1 << 20), os.urandom(999)]
    target = tmp_path / "m.gguf"
    demo.concatenate(parts(tmp_path, *chunks), target, hashlib.sha256(b"".join(chunks)).hexdigest())
    assert target.read_bytes() == b"".join(chunks)


def test_parts_that_do_not_match_their_hash_leave_nothing(tmp_path: Path) -> None:
    target = tmp_path / "store" / "m.gguf"
    target.parent.mkdir()
    with pytest.raises(demo.DemoUnavailable, match="SHA-256"):
        demo.concatenate(parts(tmp_path, b"abc"), target, hashlib.sha256(b"abd").hexdigest())
    assert list(target.parent.iterdir()) == []


def test_without_a_hash_the_parts_are_written_whole(tmp_path: Path) -> None:
    chunks = [os.urandom(2 << 20), os.urandom(7)]
    target = tmp_path / "m.gguf"
    demo.concatenate(parts(tmp_path, *chunks), target, None)
    assert target.read_bytes() == b"".join(chunks)


def test_an_unwritable_store_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(demo.DemoUnavailable, match="cannot write"):
        demo.concatenate(parts(tmp_path, b"abc"), tmp_path / "missing" / "m.gguf", hashlib.sha256(b"abc").hexdigest())


@pytest.mark.slow
def test_the_demo_model_equals_its_packages_own_assembly(tmp_path: Path) -> None:
    package = demo.demo_package()
    assert package is not None, "the bundled extra is part of make serve and make install"
    said: list[str] = []
    path = demo.start_demo_assembly(tmp_path / "store", said.append).wait()
    assert path == tmp_path / "store" / "gemma3-270m.gguf"
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == package.EXPECTED_SHA256
    assert said[0].startswith(f"store {tmp_path / 'store'} is empty: assembling") and said[-1].startswith("demo model ready")
    assert demo.assemble_demo(tmp_path / "store") is None  # not empty any more: nothing to do


def test_a_store_file_that_is_not_a_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("")
    with pytest.raises(demo.DemoUnavailable, match="cannot prepare the store"):
        demo.start_demo_assembly(tmp_path / "store", lambda line: None).wait()
