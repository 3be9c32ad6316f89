"""The fast GGUF header reader agrees with ``gguf.GGUFReader`` and rejects broken files clearly."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from trioshed.models import gguf_meta
from trioshed.models.gguf_meta import SMALL_ARRAY, ArrayInfo, GGUFError, parse_file, read_metadata
from trioshed.testing.tiny import tiny_model_shapes, write_tiny_model


def reader_value(field: gguf.ReaderField) -> Any:
    """What our reader should hold for a GGUFReader field."""
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        values = field.contents()
        if len(values) > SMALL_ARRAY:
            return ArrayInfo(field.types[-1], len(values))
        return tuple(values)
    return field.contents()


def assert_same_as_reader(path: Path) -> None:
    ours = parse_file(str(path))
    ref = gguf.GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        if len(field.types) > 2:
            continue  # GGUFReader flattens arrays of arrays; checked separately
        expected = reader_value(field)
        got = ours.fields[key]
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=1e-7), key
        else:
            assert got == expected, key
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.ggml_type == int(theirs.tensor_type), mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.nbytes == int(theirs.n_bytes), mine.name
        assert mine.offset == int(theirs.data_offset), mine.name
        assert mine.n_elements == int(theirs.n_elements), mine.name
    assert ours.file_size == path.stat().st_size


@pytest.mark.parametrize("shape", tiny_model_shapes(), ids=lambda s: s.name)
def test_matches_gguf_reader_on_tiny_models(shape, tiny_models) -> None:
    assert_same_as_reader(tiny_models[shape.name])


def test_properties_of_a_tiny_gqa_model(tiny_models) -> None:
    meta = read_metadata(tiny_models["tiny-gqa"])
    assert meta.architecture == "llama"
    assert meta.name == "tiny-gqa"
    assert meta.block_count == 4
    assert meta.embedding_length == 128
    assert meta.head_count == 4
    assert meta.head_count_kv == 2
    assert meta.head_count_kv_per_layer() == (2, 2, 2, 2)
    assert meta.key_length == meta.value_length == 32  # n_embd / n_head
    assert meta.context_length == 2048
    assert meta.sliding_window is None
    assert meta.quantization == "F32"
    assert meta.vocab_size == 132
    assert meta.chat_template is not None and "<|im_start|>" in meta.chat_template
    ref = gguf.GGUFReader(tiny_models["tiny-gqa"])
    assert meta.parameter_count == sum(int(t.n_elements) for t in ref.tensors)
    assert meta.get("tokenizer.ggml.tokens") == ArrayInfo(gguf.GGUFValueType.STRING, 132)
    assert meta.get("no.such.key", 7) == 7


def test_quantization_names(tiny_models) -> None:
    assert read_metadata(tiny_models["tiny-deep-f16"]).quantization == "F16"
    assert read_metadata(tiny_models["tiny-q8-tied"]).quantization == "Q8_0"


def write_with_arrays(path: Path, strings: list[str]) -> Path:
    """A GGUF whose long string array must be stepped over exactly for what follows to parse."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.strings", strings)
    writer.add_array("test.floats", [float(i) for i in range(1000)])
    writer.add_array("test.small", [1, 2, 3])
    writer.add_array("test.small_strings", ["a", "", "ccc"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint64("test.after", 123456789)
    writer.add_string("test.last", "end")
    writer.add_tensor("t", np.arange(48, dtype=np.float32).reshape(3, 16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "kind",
    ["plain", "nul-bytes", "long-strings", "empty-strings", "short-array"],
)
def test_long_string_arrays_are_skipped_exactly(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(1)
    n = 100 if kind == "short-array" else 5000
    strings = ["tok" + "x" * int(rng.integers(0, 12)) + str(i) for i in range(n)]
    if kind == "nul-bytes":
        strings[10] = "\x00abc"
        strings[4000] = "a\x00\x00\x00\x00\x00\x00\x00\x00b"
    elif kind == "long-strings":
        strings[7] = "y" * 300
        strings[2500] = "z" * 70000
    elif kind == "empty-strings":
        strings[3] = strings[4] = strings[4999] = ""
    path = write_with_arrays(tmp_path / f"{kind}.gguf", strings)
    assert_same_as_reader(path)
    meta = read_metadata(path)
    assert meta.get("test.strings") == ArrayInfo(gguf.GGUFValueType.STRING, n)
    assert meta.get("test.after") == 123456789
    assert meta.get("test.last") == "end"
    assert meta.get("test.nested") == ((1, 2), (3,))


def test_cache_follows_mtime_and_size(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", name="first")
    first = read_metadata(path)
    assert read_metadata(path) is first
    assert read_metadata(str(tmp_path / "." / "m.gguf")) is first  # same real path
    write_tiny_model(path, name="second-name")
    os.utime(path, ns=(time.time_ns(), first_mtime_plus(path)))
    assert read_metadata(path).name == "second-name"


def first_mtime_plus(path: Path) -> int:
    return path.stat().st_mtime_ns + 1_000_000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file"),
        (b"GGML" + bytes(100), "not a GGUF file"),
        (b"GGUF", "truncated"),
        (b"GGUF\x01\x00\x00\x00" + bytes(16), "unsupported GGUF version 1"),
        (b"GGUF\x00\x00\x00\x03" + bytes(16), "big-endian"),
        (
            b"GGUF\x03\x00\x00\x00" + (5).to_bytes(8, "little") + (1000).to_bytes(8, "little"),
            "corrupt",
        ),
    ],
    ids=["empty", "wrong-magic", "header-cut", "version-1", "big-endian", "absurd-counts"],
)
def test_bad_files_raise_gguf_error_naming_the_path(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message) as info:
        read_metadata(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("cut", [30, 200, 3000, 6000, -10])
def test_truncated_files_raise_gguf_error(tmp_path: Path, tiny_models, cut: int) -> None:
    data = tiny_models["tiny"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated"):
        read_metadata(path)


def test_truncated_inside_a_long_string_array(tmp_path: Path) -> None:
    path = write_with_arrays(tmp_path / "s.gguf", [f"token{i}" for i in range(5000)])
    data = path.read_bytes()
    for cut in (200, 20000, 40000):
        (tmp_path / "c.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            parse_file(str(tmp_path / "c.gguf"))


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_metadata(tmp_path / "absent.gguf")


def test_gemma3_fields(gemma_model) -> None:
    parse_file(str(gemma_model))  # warm the page cache
    started = time.perf_counter()
    meta = parse_file(str(gemma_model))
    elapsed = time.perf_counter() - started
    print(f"gemma3-270m header parsed in {elapsed * 1000:.1f} ms")
    assert meta.architecture == "gemma3"
    assert meta.block_count == 18
    assert meta.embedding_length == 640
    assert meta.head_count == 4
    assert meta.head_count_kv == 1
    assert meta.key_length == meta.value_length == 256
    assert meta.sliding_window == 512
    assert meta.context_length == 32768
    assert meta.quantization == "Q4_K_M"
    assert meta.vocab_size == 262144
    assert meta.get("tokenizer.ggml.tokens") == ArrayInfo(gguf.GGUFValueType.STRING, 262144)
    assert len(meta.tensors) == 236
    assert "output.weight" not in meta.tensor_map  # tied embeddings
    assert meta.tensors[-1].offset + meta.tensors[-1].nbytes <= meta.file_size
    assert 260e6 < meta.parameter_count < 280e6


def test_vector_skip_agrees_with_the_loop(gemma_model, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = parse_file(str(gemma_model))
    monkeypatch.setattr(gguf_meta, "_VECTOR_MIN", 10**12)
    slow = parse_file(str(gemma_model))
    assert fast.tensors == slow.tensors
    assert dict(fast.fields) == dict(slow.fields)


@pytest.mark.parametrize("first_read", [24, 100, 4096])
def test_small_reads_move_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_read: int
) -> None:
    path = write_with_arrays(tmp_path / "s.gguf", [f"token{i}" for i in range(5000)])
    expected = parse_file(str(path))
    monkeypatch.setattr(gguf_meta, "_CHUNK", first_read)
    for vector_min in (2048, 10**12):  # the numpy path and the loop
        monkeypatch.setattr(gguf_meta, "_VECTOR_MIN", vector_min)
        got = parse_file(str(path))
        assert got.tensors == expected.tensors
        assert dict(got.fields) == dict(expected.fields)
