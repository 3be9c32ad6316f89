"""Reading an Ollama store, several store folders, copy and delete in the folder store (no processes)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from trioshed.errors import BadRequest, Conflict, Forbidden, ModelNotFound
from trioshed.models.capabilities import capabilities
from trioshed.models.ollama_store import OllamaManifest, OllamaStore, is_ollama_store, parse_name
from trioshed.models.store import ModelStore
from trioshed.models.stores import Stores, store_folders
from trioshed.testing.ollama_store import add_ollama_model


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` with its mtime and content hash: what "never writes" compares."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def ollama_root(tmp_path: Path, tiny_model: Path) -> Path:
    root = tmp_path / "ollama"
    add_ollama_model(root, "llama3.2:1b", tiny_model, params={"stop": ["<|eot|>"], "temperature": 0.6, "num_ctx": 1024},
                     template="{{ if .Tools }}tools{{ end }}{{ .Prompt }}", system="You are terse.")  # fmt: skip
    add_ollama_model(root, "someone/helper:q8", tiny_model)
    add_ollama_model(root, "hf.co/org/Repo-GGUF:Q4_K_M", tiny_model, projector=tiny_model)
    return root


@pytest.mark.parametrize(
    ("name", "display"),
    [("llama3.2", "llama3.2:latest"), ("llama3.2:1b", "llama3.2:1b"), ("library/llama3.2:1b", "llama3.2:1b"),
     ("registry.ollama.ai/library/llama3.2:1b", "llama3.2:1b"), ("user/m:t", "user/m:t"),
     ("registry.ollama.ai/user/m", "user/m:latest"), ("hf.co/org/Repo:Q4", "hf.co/org/Repo:Q4"),
     ("localhost:5000/ns/m", "localhost:5000/ns/m:latest")],
)  # fmt: skip
def test_names_as_ollama_shows_them(name: str, display: str) -> None:
    assert parse_name(name).display() == display


@pytest.mark.parametrize("bad", ["", "../x", "a/../b", "a/b/c/d", "x:../../y", "/abs", "a//b"])
def test_unsafe_names_are_refused(bad: str) -> None:
    with pytest.raises(BadRequest):
        parse_name(bad)


def test_reads_manifests_and_blobs(ollama_root: Path, tiny_model: Path) -> None:
    assert is_ollama_store(ollama_root) and not is_ollama_store(tiny_model.parent)
    store = OllamaStore(ollama_root)
    assert sorted(s.name for s in store.list()) == ["hf.co/org/Repo-GGUF:Q4_K_M", "llama3.2:1b", "someone/helper:q8"]
    spec = store.resolve("registry.ollama.ai/library/LLaMA3.2:1B")  # library/ and the registry implied; any case
    blob = ollama_root / "blobs" / f"sha256-{hashlib.sha256(tiny_model.read_bytes()).hexdigest()}"
    assert spec.name == "llama3.2:1b" and spec.path == str(blob) and spec.projector is None
    assert dict(spec.defaults) == {"stop": ["<|eot|>"], "temperature": 0.6, "num_ctx": 1024}
    assert spec.system == "You are terse."
    origin = spec.origin
    assert isinstance(origin, OllamaManifest)
    manifest = ollama_root / "manifests/registry.ollama.ai/library/llama3.2/1b"
    assert origin.digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert origin.template.startswith("{{ if .Tools }}") and origin.family == "llama" and origin.parameter_size == "1M"
    assert spec.size > tiny_model.stat().st_size  # layers + config, as Ollama lists it
    assert store.resolve("hf.co/org/Repo-GGUF:Q4_K_M").projector == str(blob)
    with pytest.raises(ModelNotFound):
        store.resolve("llama3.2:3b")


def test_broken_manifest_is_skipped_in_listings(ollama_root: Path) -> None:
    bad = ollama_root / "manifests/registry.ollama.ai/library/broken/latest"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:' + "0" * 64 + '"}]}')
    assert "broken:latest" not in {s.name for s in OllamaStore(ollama_root).list()}
    with pytest.raises(BadRequest, match="missing"):
        OllamaStore(ollama_root).resolve("broken")


def test_several_folders_first_wins(tmp_path: Path, ollama_root: Path, tiny_model: Path) -> None:
    folder = tmp_path / "own"
    folder.mkdir()
    os.link(tiny_model, folder / "mine.gguf")
    os.link(tiny_model, folder / "llama3.2.gguf")
    value = f"{folder}{os.pathsep}{ollama_root}"
    assert store_folders(value) == [folder, ollama_root]
    stores = Stores(value)
    names = [s.name for s in stores.list()]
    assert names == ["hf.co/org/Repo-GGUF:Q4_K_M", "llama3.2:1b", "llama3.2:latest", "mine:latest", "someone/helper:q8"]
    assert stores.resolve("llama3.2").path == str(folder / "llama3.2.gguf")
    assert isinstance(stores.resolve("someone/helper:q8").origin, OllamaManifest)
    assert stores.digest(stores.resolve("llama3.2:1b")) == stores.resolve("llama3.2:1b").origin.digest  # type: ignore[union-attr]
    with pytest.raises(ModelNotFound):
        stores.resolve("nothing/here")
    with pytest.raises(BadRequest):  # refused by both kinds of store
        stores.resolve("../x")


def test_ollama_store_is_never_written(tmp_path: Path, ollama_root: Path, tiny_model: Path) -> None:
    folder = tmp_path / "own"
    folder.mkdir()
    before = snapshot(ollama_root)
    stores = Stores(f"{folder}{os.pathsep}{ollama_root}")
    stores.list()
    with pytest.raises(Forbidden, match="ollama rm"):
        stores.delete("llama3.2:1b")
    assert stores.copy("llama3.2:1b", "small") == "small:latest"  # into the folder store
    copied = stores.resolve("small")
    original = stores.resolve("llama3.2:1b")
    assert (copied.path, copied.defaults, copied.system) == (original.path, original.defaults, original.system)
    stores.delete("small")
    with pytest.raises(ModelNotFound):
        stores.resolve("small")
    assert snapshot(ollama_root) == before
    only_ollama = Stores(str(ollama_root))
    with pytest.raises(Forbidden, match="folder store"):
        only_ollama.copy("llama3.2:1b", "x")
    assert snapshot(ollama_root) == before


def test_copy_and_delete_in_the_folder_store(tmp_path: Path, tiny_model: Path) -> None:
    os.link(tiny_model, tmp_path / "base.gguf")
    toml = tmp_path / "models.toml"
    toml.write_text('# my models\n[models.tuned]\npath = "base.gguf"\noptions = { temperature = 0.2 }\n\n[models.other]\npath = "base.gguf"\n')
    stores = Stores(tmp_path)
    text = toml.read_text()
    assert stores.copy("tuned", "tuned:latest") == "tuned:latest" and toml.read_text() == text  # onto itself: nothing
    assert stores.copy("tuned", "tuned-copy:v2") == "tuned-copy:v2"
    spec = stores.resolve("tuned-copy:v2")
    assert spec.path == str(tmp_path / "base.gguf") and dict(spec.defaults) == {"temperature": 0.2}
    assert toml.read_text().startswith("# my models\n")  # the rest of the file is kept as it was
    stores.copy("base", "tuned-copy:v2")  # a copy onto an existing entry replaces it, as Ollama does
    assert stores.resolve("tuned-copy:v2").defaults == ()
    with pytest.raises(Conflict, match="tuned"):  # the file of other entries: those go first
        stores.delete("base")
    for name in ("tuned", "other", "tuned-copy:v2"):
        stores.delete(name)
    assert (tmp_path / "base.gguf").exists() and "[models" not in toml.read_text()
    stores.delete("base")
    assert not (tmp_path / "base.gguf").exists()
    with pytest.raises(ModelNotFound):
        stores.delete("base")
    with pytest.raises(ModelNotFound):
        stores.copy("base", "again")
    with pytest.raises(BadRequest):
        Stores(tmp_path).copy("base", "../escape")


def test_delete_one_name_keeps_the_others(tmp_path: Path, tiny_model: Path) -> None:
    """As Ollama removes one name and leaves its copies: an alias leaves the aliases list; an
    entry's own name passes the entry on to its first alias."""
    os.link(tiny_model, tmp_path / "base.gguf")
    toml = tmp_path / "models.toml"
    toml.write_text('[models.main]\npath = "base.gguf"\naliases = ["a1", "a2:v"]\nnum_parallel = 2\n')
    stores = Stores(tmp_path)
    stores.delete("a2:v")
    assert {s.name for s in stores.list()} == {"base:latest", "main:latest", "a1:latest"}
    stores.delete("main")
    a1 = stores.resolve("a1")
    assert a1.num_parallel == 2 and a1.path == str(tmp_path / "base.gguf")
    assert {s.name for s in stores.list()} == {"base:latest", "a1:latest"}
    with pytest.raises(Conflict, match="alias of"):
        toml.write_text('[models.main]\npath = "base.gguf"\naliases = ["taken"]\n')
        stores.copy("base", "taken")
    assert stores.catalogue().lookup("taken:latest") is not None


def test_copy_refuses_an_inline_models_table(tmp_path: Path, tiny_model: Path) -> None:
    os.link(tiny_model, tmp_path / "base.gguf")
    toml = tmp_path / "models.toml"
    toml.write_text('models = { a = { path = "base.gguf" } }\n')
    with pytest.raises(Conflict, match="by hand"):
        Stores(tmp_path).copy("base", "b")
    assert toml.read_text() == 'models = { a = { path = "base.gguf" } }\n'
    assert ModelStore(tmp_path).resolve("a").path == str(tmp_path / "base.gguf")


@pytest.mark.parametrize(
    ("fields", "template", "projector", "expected"),
    [
        ({"general.architecture": "llama"}, "", False, ["completion"]),
        ({"general.architecture": "bert", "bert.pooling_type": 1}, "", False, ["embedding"]),
        ({"general.architecture": "gemma3", "gemma3.vision.block_count": 27}, "", False, ["completion", "vision"]),
        ({"general.architecture": "llama"}, "{{ .Prompt }}", True, ["completion", "vision"]),
        ({"general.architecture": "qwen3"}, "{% if tools %}{% endif %}<think>", False, ["completion", "tools", "thinking"]),
        ({"general.architecture": "llama"}, "{{ .Prompt }}{{ .Suffix }}", False, ["completion", "insert"]),
        ({"general.architecture": "llama", "tokenizer.ggml.fim_pre_token_id": 5}, "", False, ["completion", "insert"]),
    ],
)
def test_capabilities_as_ollama_reports_them(fields: dict[str, object], template: str, projector: bool, expected: list[str]) -> None:
    assert capabilities(fields, template, projector=projector) == expected


def test_model_system_prompt_applies_where_the_request_brings_none() -> None:
    from trioshed.api.protocols.ollama import with_model_system

    assert with_model_system("generate", {"prompt": "p"}, "S") == {"prompt": "p", "system": "S"}
    assert with_model_system("generate", {"prompt": "p", "system": "mine"}, "S")["system"] == "mine"
    chat = with_model_system("chat", {"messages": [{"role": "user", "content": "u"}]}, "S")
    assert chat["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    own = {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "u"}]}
    assert with_model_system("chat", own, "S") == own
    assert with_model_system("chat", {"messages": []}, "S") == {"messages": []}
    assert with_model_system("generate", {"prompt": "p"}, "") == {"prompt": "p"}
