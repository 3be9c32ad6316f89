"""The pure part of a pull: names, manifests, the Hugging Face file choice, progress lines."""

from __future__ import annotations

import hashlib
import json

import pytest

from trioshed.errors import BadRequest, ModelNotFound, NotSupported, RegistryError
from trioshed.models import ollama_store as o
from trioshed.models.pull_plan import (
    HfFile,
    Layer,
    bytes_to_fetch,
    choose_hf_files,
    content_range_start,
    hf_plan,
    manifest_path_parts,
    parse_challenge,
    parse_hf_tree,
    parse_manifest,
    parse_target,
    progress,
)

H = "ab" * 32


def test_targets_follow_ollamas_names() -> None:
    t = parse_target("llama3.2:1b")
    assert (t.source, t.display, t.repository) == ("ollama", "llama3.2:1b", "library/llama3.2")
    assert parse_target("registry.ollama.ai/library/llama3.2").display == "llama3.2:latest"
    assert parse_target("someone/helper:q8").repository == "someone/helper"
    assert parse_target("localhost:5000/ns/m:t").name.host == "localhost:5000"
    hf = parse_target("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert (hf.source, hf.display) == ("hf", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert parse_target("huggingface.co/u/r:Q8_0").display == "hf.co/u/r:Q8_0"


@pytest.mark.parametrize("name", ["", "../x", "a/../../b", "a/b/c/d", "x:../y", "m@sha256:" + H, "a\0b", "..", "/abs", 5])
def test_unsafe_or_unsupported_names_are_400(name: object) -> None:
    with pytest.raises(BadRequest):
        parse_target(name)


def test_manifest_parts_never_escape() -> None:
    for bad in ("..", ".", "a/b", "", "x\\y"):
        with pytest.raises(BadRequest):
            manifest_path_parts(o.OllamaName("h", bad, "m", "t"))


def _manifest(layers: list[dict[str, object]], config: object = None) -> bytes:
    config = config if config is not None else {"mediaType": "c", "digest": "sha256:" + "cd" * 32, "size": 10}
    return json.dumps({"schemaVersion": 2, "config": config, "layers": layers}).encode()


def test_manifest_is_validated() -> None:
    target = parse_target("m")
    good = {"mediaType": o.MEDIA_MODEL, "digest": "sha256:" + H, "size": 5}
    plan = parse_manifest(target, _manifest([good, {**good}]))
    assert [layer.digest for layer in plan.layers] == ["sha256:" + H, "sha256:" + "cd" * 32]  # deduplicated, config last
    assert plan.total == 15
    for bad_layer in (
        {**good, "digest": "sha256:../../etc/passwd"},
        {**good, "digest": "sha256:" + H.upper()},
        {**good, "digest": "md5:" + H},
        {**good, "size": -1},
        {**good, "size": True},
        {**good, "size": 1 << 50},
        {"mediaType": o.MEDIA_TEMPLATE, "digest": "sha256:" + H, "size": 1 << 30},
    ):
        with pytest.raises(RegistryError):
            parse_manifest(target, _manifest([good, bad_layer]))
    with pytest.raises(RegistryError):
        parse_manifest(target, b"not json")
    with pytest.raises(RegistryError):
        parse_manifest(target, b"{" + b" " * (1 << 20) + b"}")
    with pytest.raises(RegistryError):
        parse_manifest(target, _manifest([good], config="x"))
    with pytest.raises(NotSupported):  # a safetensors-only model: llama-server cannot serve it
        parse_manifest(target, _manifest([{**good, "mediaType": "application/vnd.ollama.image.tensor"}]))


def _files(*names: str) -> list[HfFile]:
    return [HfFile(n, 100 + i, hashlib.sha256(n.encode()).hexdigest()) for i, n in enumerate(names)]


REPO = ("Model-Q4_K_M.gguf", "Model-Q8_0.gguf", "model-iq4_xs.gguf", "Model-Q4_K_M-imatrix.gguf",
        "mmproj-Model-F16.gguf", "mmproj-Model-Q8_0.gguf", "README.md")  # fmt: skip


@pytest.mark.parametrize(
    ("tag", "model", "projector"),
    [
        ("Q4_K_M", "Model-Q4_K_M.gguf", "mmproj-Model-F16.gguf"),
        ("q4_k_m", "Model-Q4_K_M.gguf", "mmproj-Model-F16.gguf"),  # any letter case
        ("Q8_0", "Model-Q8_0.gguf", "mmproj-Model-Q8_0.gguf"),  # the projector of the same quant
        ("IQ4_XS", "model-iq4_xs.gguf", "mmproj-Model-F16.gguf"),
        ("latest", "Model-Q4_K_M.gguf", "mmproj-Model-F16.gguf"),  # Q4_K_M by default
        ("model-q8_0.gguf", "Model-Q8_0.gguf", "mmproj-Model-F16.gguf"),  # a file name as the tag
    ],
)
def test_hf_file_choice(tag: str, model: str, projector: str) -> None:
    choice = choose_hf_files(parse_target(f"hf.co/u/r:{tag}"), _files(*REPO))
    assert choice.model.path == model
    assert choice.projector is not None and choice.projector.path == projector


def test_hf_choice_rules_and_errors() -> None:
    t = parse_target
    # a quant is a word of its own: Q4_K is not Q4_K_M, Q4_K_M is not IQ4_K_M
    assert choose_hf_files(t("hf.co/u/r:Q4_K"), _files("m-Q4_K_M.gguf", "m-Q4_K.gguf")).model.path == "m-Q4_K.gguf"
    with pytest.raises(ModelNotFound, match=r"no GGUF file for quant 'Q4_K_M'.*m-IQ4_K_M.gguf"):
        choose_hf_files(t("hf.co/u/r:Q4_K_M"), _files("m-IQ4_K_M.gguf"))
    # no tag: Q4_K_M, else Q8_0, else the only model file
    assert choose_hf_files(t("hf.co/u/r"), _files("a-Q8_0.gguf", "a-F16.gguf")).model.path == "a-Q8_0.gguf"
    only = choose_hf_files(t("hf.co/u/r"), _files("a-F16.gguf", "mmproj-a.gguf"))
    assert only.model.path == "a-F16.gguf" and only.quant == "" and only.projector is not None
    with pytest.raises(BadRequest, match=r"several GGUF files.*none is Q4_K_M"):
        choose_hf_files(t("hf.co/u/r"), _files("a-F16.gguf", "a-BF16.gguf"))
    # several files for one quant: 400, naming them and how to pick one
    with pytest.raises(BadRequest, match=r"several GGUF files .* match 'Q4_K_M': a/x-Q4_K_M.gguf, b/x-Q4_K_M.gguf; name one"):
        choose_hf_files(t("hf.co/u/r:Q4_K_M"), _files("a/x-Q4_K_M.gguf", "b/x-Q4_K_M.gguf"))
    # split GGUFs: 501 with the way out
    with pytest.raises(NotSupported, match=r"split GGUF.*llama-gguf-split --merge"):
        choose_hf_files(t("hf.co/u/r:Q4_K_M"), _files("x-Q4_K_M-00001-of-00002.gguf", "x-Q4_K_M-00002-of-00002.gguf"))
    with pytest.raises(ModelNotFound, match=r"no GGUF model file"):
        choose_hf_files(t("hf.co/u/r"), _files("README.md", "mmproj-x.gguf"))
    # a model file not in LFS has no sha256 to verify against
    with pytest.raises(RegistryError, match=r"no sha256"):
        choose_hf_files(t("hf.co/u/r:Q8_0"), [HfFile("x-Q8_0.gguf", 5, "")])


def test_hf_tree_drops_unsafe_paths() -> None:
    sha = "ef" * 32
    tree = [
        {"type": "file", "path": "ok/x-Q8_0.gguf", "size": 1, "lfs": {"oid": sha, "size": 7}},
        {"type": "file", "path": "../x-Q8_0.gguf", "size": 1, "lfs": {"oid": sha, "size": 7}},
        {"type": "file", "path": "/abs.gguf", "size": 1},
        {"type": "file", "path": "a/./b.gguf", "size": 1},
        {"type": "directory", "path": "ok"},
        {"type": "file", "path": "small.txt", "size": 3, "oid": "1" * 40},
    ]
    assert parse_hf_tree(tree) == [HfFile("ok/x-Q8_0.gguf", 7, sha), HfFile("small.txt", 3, "")]
    with pytest.raises(RegistryError):
        parse_hf_tree({"error": "x"})


def test_hf_plan_is_an_ollama_manifest() -> None:
    target = parse_target("hf.co/u/r:Q8_0")
    choice = choose_hf_files(target, _files(*REPO))
    plan = hf_plan(target, choice, model_url="http://x/m", projector_url="http://x/p")
    manifest = json.loads(plan.manifest)
    assert [layer["mediaType"] for layer in manifest["layers"]] == [o.MEDIA_MODEL, o.MEDIA_PROJECTOR]
    assert manifest["layers"][0]["digest"] == "sha256:" + choice.model.sha256
    config = plan.layers[-1]
    assert config.data is not None and json.loads(config.data)["file_type"] == "Q8_0"
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(config.data).hexdigest()


def test_http_details() -> None:
    scheme, params = parse_challenge('Bearer realm="https://r/token",service="svc",scope="repository:a/b:pull"')
    assert scheme == "bearer" and params == {"realm": "https://r/token", "service": "svc", "scope": "repository:a/b:pull"}
    assert content_range_start("bytes 10-99/100", 100) == 10
    assert content_range_start("bytes 10-99/*", 100) == 10
    assert content_range_start("bytes 10-98/100", 100) is None
    assert content_range_start("bytes 10-99/200", 100) is None
    assert content_range_start(None, 100) is None


def test_bytes_to_fetch_counts_partial_downloads() -> None:
    target = parse_target("m")
    plan = parse_manifest(target, _manifest([{"mediaType": o.MEDIA_MODEL, "digest": "sha256:" + H, "size": 100}]))
    assert bytes_to_fetch(plan, {}) == 110
    assert bytes_to_fetch(plan, {"sha256:" + H: 60}) == 50
    assert bytes_to_fetch(plan, {"sha256:" + H: 100, "sha256:" + "cd" * 32: 10}) == 0


def test_progress_lines_have_ollamas_shape() -> None:
    layer = Layer(o.MEDIA_MODEL, "sha256:" + H, 100)
    assert progress("pulling manifest") == {"status": "pulling manifest"}
    assert progress(f"pulling {layer.short}", layer, 40) == {
        "status": "pulling " + H[:12], "digest": "sha256:" + H, "total": 100, "completed": 40,
    }  # fmt: skip
