"""Projectors are never models: a folder store pairs them with their models on its own where
that is unambiguous, ``models.toml`` wins, and an ambiguous folder is logged and reported."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trioshed.errors import ModelNotFound
from trioshed.models.projectors import first_architecture, pair_folder
from trioshed.models.store import ModelStore
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import write_tiny_audio_projector, write_tiny_vision_projector


def test_hugging_face_names_pair_with_every_quant_of_their_model() -> None:
    pairing = pair_folder([
        "gemma-3-4b-it-Q4_K_M.gguf", "gemma-3-4b-it-Q8_0.gguf", "mmproj-gemma-3-4b-it-f16.gguf",
        "Qwen2.5-VL-7B-Instruct-UD-Q4_K_XL.gguf", "Qwen2.5-VL-7B-Instruct-mmproj-f16.gguf", "llama.gguf",
    ])  # fmt: skip
    assert dict(pairing.paired) == {
        "gemma-3-4b-it-Q4_K_M.gguf": "mmproj-gemma-3-4b-it-f16.gguf",
        "gemma-3-4b-it-Q8_0.gguf": "mmproj-gemma-3-4b-it-f16.gguf",
        "Qwen2.5-VL-7B-Instruct-UD-Q4_K_XL.gguf": "Qwen2.5-VL-7B-Instruct-mmproj-f16.gguf",
    }
    assert not pairing.ambiguous  # llama.gguf simply has no projector


def test_one_model_and_one_projector_go_together_whatever_their_names() -> None:
    assert dict(pair_folder(["a.gguf", "mmproj-f16.gguf"]).paired) == {"a.gguf": "mmproj-f16.gguf"}
    assert dict(pair_folder(["a.gguf", "vision.gguf"], projectors=["vision.gguf"]).paired) == {"a.gguf": "vision.gguf"}


@pytest.mark.parametrize(
    ("names", "model", "reason"),
    [
        (["a.gguf", "b.gguf", "mmproj-f16.gguf"], "a.gguf", "match none (mmproj-f16.gguf)"),
        (["a.gguf", "mmproj-a-f16.gguf", "mmproj-a-bf16.gguf"], "a.gguf", "several projectors match"),
        (["a.gguf", "mmproj-x.gguf", "mmproj-y.gguf"], "a.gguf", "match none"),
    ],
)
def test_an_ambiguous_folder_is_never_guessed(names: list[str], model: str, reason: str) -> None:
    pairing = pair_folder(names)
    assert model not in pairing.paired
    assert reason in pairing.ambiguous[model]


def test_first_architecture_reads_the_first_key(tmp_path: Path) -> None:
    assert first_architecture(str(write_tiny_vision_projector(tmp_path / "v.gguf"))) == "clip"
    assert first_architecture(str(write_tiny_model(tmp_path / "m.gguf"))) == "llama"
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    assert first_architecture(str(tmp_path / "junk.gguf")) is None
    assert first_architecture(str(tmp_path / "missing.gguf")) is None


def _names(store: ModelStore) -> dict[str, str | None]:
    return {s.name: (Path(s.projector).name if s.projector else None) for s in store.list()}


def test_a_projector_only_folder_lists_nothing(tmp_path: Path) -> None:
    write_tiny_vision_projector(tmp_path / "mmproj.gguf")
    write_tiny_vision_projector(tmp_path / "vision.gguf")  # a projector by its header only
    store = ModelStore(tmp_path)
    assert store.list() == []
    for name in ("mmproj", "vision"):
        with pytest.raises(ModelNotFound):
            store.resolve(name)


def test_a_model_and_its_projector_pair_on_their_own(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "tiny.gguf")
    write_tiny_vision_projector(tmp_path / "mmproj.gguf")
    store = ModelStore(tmp_path)
    assert _names(store) == {"tiny:latest": "mmproj.gguf"}
    spec = store.resolve("tiny")
    assert spec.projector == str(tmp_path / "mmproj.gguf") and spec.projector_problem == ""


def test_two_models_with_two_projectors(tmp_path: Path) -> None:
    for name in ("tiny", "other"):
        write_tiny_model(tmp_path / f"{name}.gguf")
    write_tiny_vision_projector(tmp_path / "mmproj-tiny-f16.gguf")
    write_tiny_audio_projector(tmp_path / "other-mmproj.gguf")
    store = ModelStore(tmp_path)
    assert _names(store) == {"other:latest": "other-mmproj.gguf", "tiny:latest": "mmproj-tiny-f16.gguf"}


def test_an_ambiguous_folder_is_logged_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("tiny", "other"):
        write_tiny_model(tmp_path / f"{name}.gguf")
    write_tiny_vision_projector(tmp_path / "mmproj-f16.gguf")
    store = ModelStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trioshed.models.store"):
        assert _names(store) == {"other:latest": None, "tiny:latest": None}
    assert "no projector for" in caplog.text and "mmproj-f16.gguf" in caplog.text
    assert "match none (mmproj-f16.gguf)" in store.resolve("tiny").projector_problem


def test_models_toml_wins(tmp_path: Path) -> None:
    for name in ("tiny", "other"):
        write_tiny_model(tmp_path / f"{name}.gguf")
    write_tiny_vision_projector(tmp_path / "mmproj-f16.gguf")
    write_tiny_vision_projector(tmp_path / "mmproj-tiny.gguf")
    (tmp_path / "models.toml").write_text('[models.see]\npath = "other.gguf"\nprojector = "mmproj-f16.gguf"\n[models.plain]\npath = "tiny.gguf"\n')
    store = ModelStore(tmp_path)
    names = _names(store)
    assert names["see:latest"] == "mmproj-f16.gguf"
    assert names["tiny:latest"] == names["plain:latest"] == "mmproj-tiny.gguf"  # an entry without one: the folder's


def test_a_sub_folder_is_one_model_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "gemma-vision" / "gemma-3-4b-it-Q4_K_M.gguf")
    write_tiny_vision_projector(tmp_path / "gemma-vision" / "mmproj-model-f16.gguf")
    write_tiny_model(tmp_path / "two" / "a.gguf")
    write_tiny_model(tmp_path / "two" / "b.gguf")  # two models: not one model's folder
    store = ModelStore(tmp_path)
    assert _names(store) == {"gemma-vision:latest": "mmproj-model-f16.gguf"}
    assert store.resolve("gemma-vision").path == str(tmp_path / "gemma-vision" / "gemma-3-4b-it-Q4_K_M.gguf")
    with pytest.raises(ModelNotFound):
        store.resolve("two")
