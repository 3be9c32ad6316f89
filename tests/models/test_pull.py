"""Pulls against loopback stand-ins of the Ollama registry and of Hugging Face.

No internet: :mod:`trioshed.testing.registry` serves the registry's and Hugging Face's HTTP APIs
from the test's own loop; trioshed's :class:`Puller` fetches from it into a temporary store, and
the store is then read by the same Ollama-store reader that serves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from trioshed.errors import (
    BadRequest,
    Forbidden,
    InsufficientStorage,
    ModelNotFound,
    RegistryError,
    TrioshedError,
)
from trioshed.models import ollama_store as o
from trioshed.models.pull import Puller
from trioshed.models.registry_client import Registries
from trioshed.models.stores import Stores
from trioshed.testing.registry import StandIn, open_stand_in, tree_snapshot

TEMPLATE = "{{ .Prompt }}"
PARAMS = {"num_predict": 3, "stop": ["<|eot|>"]}


@pytest.fixture
def gguf(tiny_model: Path) -> bytes:
    return tiny_model.read_bytes()


def puller(root: Path, stand_in: StandIn, **kwargs: Any) -> Puller:
    registries = Registries(ollama=stand_in.base_url, hf=stand_in.base_url, hf_token=kwargs.pop("hf_token", None),
                            registry_token=kwargs.pop("registry_token", None))  # fmt: skip
    kwargs.setdefault("backoff", 0.0)
    return Puller(root, registries=registries, **kwargs)


async def collect(p: Puller, name: str, **kwargs: Any) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []

    async def report(line: dict[str, Any]) -> None:
        lines.append(line)

    await p.pull(name, report, **kwargs)
    return lines


def content(path: str) -> bytes:
    return Path(path).read_bytes()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_shape(lines: list[dict[str, Any]]) -> None:
    """Ollama's order: pulling manifest, per-layer lines, verifying, writing manifest, success."""
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    for line in lines[1:-3]:
        assert set(line) == {"status", "digest", "total", "completed"}
        assert line["status"] == f"pulling {line['digest'][7:19]}"
        assert 0 <= line["completed"] <= line["total"]
    by_digest: dict[str, list[int]] = {}
    for line in lines[1:-3]:
        by_digest.setdefault(line["digest"], []).append(line["completed"])
    for digest, done in by_digest.items():
        assert done == sorted(done) and done[-1] == next(x["total"] for x in lines if x.get("digest") == digest)


async def test_pull_from_the_ollama_registry(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "store" / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("tiny-llama:1b", gguf, template=TEMPLATE, params=PARAMS, system="Be brief.",
                                  projector=b"projector-bytes", adapters=(b"lora-bytes",))  # fmt: skip
        lines = await collect(puller(root, stand_in), "tiny-llama:1b")
    check_shape(lines)
    assert {line["digest"] for line in lines if "digest" in line} == {sha(b) for b in stand_in.blobs.values()}
    spec = o.OllamaStore(root).resolve("tiny-llama:1b")
    assert content(spec.path) == gguf
    assert spec.projector is not None and content(spec.projector) == b"projector-bytes"
    assert [content(a) for a in spec.adapters] == [b"lora-bytes"]
    assert dict(spec.defaults) == PARAMS and spec.system == "Be brief."
    assert isinstance(spec.origin, o.OllamaManifest) and spec.origin.template == TEMPLATE
    manifest = root / "manifests/registry.ollama.ai/library/tiny-llama/1b"
    assert manifest.read_bytes() == stand_in.manifests[("library", "tiny-llama", "1b")]  # as the registry sent it
    assert not list(root.rglob("*partial*")) and not list(root.rglob("*.tmp"))
    # the manifest was asked for as Ollama asks, the blobs by digest through the registry's redirect
    first = stand_in.requests[0]
    assert first.path == "/v2/library/tiny-llama/manifests/1b"
    assert first.headers["accept"] == "application/vnd.docker.distribution.manifest.v2+json"
    # pulling again downloads nothing: every layer is reported complete at once
    async with open_stand_in(stand_in):
        stand_in.requests.clear()
        again = await collect(puller(root, stand_in), "tiny-llama:1b")
    check_shape(again)
    assert [r.path for r in stand_in.requests] == ["/v2/library/tiny-llama/manifests/1b"]


async def test_pull_from_hugging_face(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    files = {"Tiny-Q8_0.gguf": gguf, "Tiny-Q4_K_M.gguf": gguf + b"\0", "mmproj-Tiny-F16.gguf": b"mm", "README.md": b"hi"}
    async with open_stand_in() as stand_in:
        stand_in.add_hf_repo("someone/Tiny-GGUF", files)
        lines = await collect(puller(root, stand_in, hf_token="hf_secret"), "hf.co/someone/Tiny-GGUF:q8_0")
        with pytest.raises(ModelNotFound, match=r"no GGUF file for quant 'Q2_K'.*Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf"):
            await collect(puller(root, stand_in), "hf.co/someone/Tiny-GGUF:Q2_K")
        with pytest.raises(ModelNotFound, match=r"does not exist"):
            await collect(puller(root, stand_in), "hf.co/someone/Nothing-GGUF:Q8_0")
    check_shape(lines)
    spec = o.OllamaStore(root).resolve("hf.co/someone/Tiny-GGUF:q8_0")
    assert spec.name == "hf.co/someone/Tiny-GGUF:q8_0"  # named as Ollama names it
    assert content(spec.path) == gguf
    assert spec.projector is not None and content(spec.projector) == b"mm"
    assert isinstance(spec.origin, o.OllamaManifest) and spec.origin.quantization_level == "Q8_0"
    listing = next(r for r in stand_in.requests if r.path.startswith("/api/models/"))
    assert listing.path == "/api/models/someone/Tiny-GGUF/tree/main"
    assert listing.headers["authorization"] == "Bearer hf_secret"  # HF_TOKEN
    assert any(r.path == "/someone/Tiny-GGUF/resolve/main/Tiny-Q8_0.gguf" for r in stand_in.requests)
    cdn = [r for r in stand_in.requests if r.path.startswith("/cdn/")]
    assert cdn and all("authorization" not in r.headers or r.headers["authorization"] == "Bearer hf_secret" for r in cdn)


async def test_resume_after_a_cut_connection(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        digest = sha(gguf)
        stand_in.cut[digest] = len(gguf) // 3
        lines = await collect(puller(root, stand_in), "m")
    check_shape(lines)
    gets = stand_in.blob_requests(digest)
    assert [g.headers.get("range") for g in gets] == [None, f"bytes={len(gguf) // 3}-"]
    assert (root / f"blobs/sha256-{digest[7:]}").read_bytes() == gguf


async def test_an_interrupted_pull_resumes_in_the_next_one(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        digest = sha(gguf)
        stand_in.cut[digest] = 1000
        stand_in.cut_always = True
        with pytest.raises(RegistryError, match=r"interrupted 2 times.*2000 of .* bytes are kept: pull again to resume"):
            await collect(puller(root, stand_in, retries=1), "m")
        assert (root / f"blobs/sha256-{digest[7:]}-partial").stat().st_size == 2000
        assert [g.headers.get("range") for g in stand_in.blob_requests(digest)] == [None, "bytes=1000-"]
        assert not (root / "manifests").exists()  # nothing visible
        assert o.OllamaStore(root).list() == []
        stand_in.cut.clear()
        stand_in.requests.clear()
        lines = await collect(puller(root, stand_in), "m")
    check_shape(lines)
    model_lines = [line for line in lines if line.get("digest") == digest]
    assert model_lines[0]["completed"] == 2000  # the progress starts where the last pull stopped
    assert [g.headers.get("range") for g in stand_in.blob_requests(digest)] == ["bytes=2000-"]
    assert content(o.OllamaStore(root).resolve("m").path) == gguf


async def test_a_wrong_digest_keeps_nothing(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / "sha256-keep").write_bytes(b"an earlier pull's")
    before = tree_snapshot(root)
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf, template=TEMPLATE)
        stand_in.tamper.add(sha(gguf))
        with pytest.raises(RegistryError, match=r"digest mismatch for [0-9a-f]{12}.*nothing was kept"):
            await collect(puller(root, stand_in), "m")
    after = tree_snapshot(root)
    # only the layers that were verified before the model layer failed may stay (none here: it is first)
    assert after == before


async def test_unknown_names_are_404_and_bad_names_400(tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        with pytest.raises(ModelNotFound) as info:
            await collect(puller(root, stand_in), "nothere:7b")
        assert info.value.status == 404 and "file does not exist" in info.value.message
        with pytest.raises(BadRequest):
            await collect(puller(root, stand_in), "../../etc:x")
    assert not root.exists()


async def test_a_registry_that_asks_for_a_token(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in(StandIn(token="granted")) as stand_in:
        stand_in.add_ollama_model("m", gguf)
        check_shape(await collect(puller(root, stand_in), "m"))
    paths = [r.path for r in stand_in.requests]
    assert paths[:3] == ["/v2/library/m/manifests/latest", "/token", "/v2/library/m/manifests/latest"]
    assert stand_in.requests[2].headers["authorization"] == "Bearer granted"


async def test_a_full_disk_is_507_before_anything_is_written(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        seen: list[Path] = []

        def free(path: Path) -> int:
            seen.append(path)
            return len(gguf)  # the model fits, the margin does not

        with pytest.raises(InsufficientStorage) as info:
            await collect(puller(root, stand_in, free_space=free), "m")
    assert info.value.status == 507 and "not enough disk space" in info.value.message
    assert seen and not root.exists()
    assert all("/cdn/" not in r.path for r in stand_in.requests)


async def test_two_concurrent_pulls_share_one_download(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        stand_in.add_ollama_model("other/m:alias", gguf, template=TEMPLATE)
        digest = sha(gguf)
        stand_in.gate[digest] = trio.Event()
        p = puller(root, stand_in)
        results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        follower_waiting = trio.Event()

        async def run(key: str, name: str) -> None:
            async def report(line: dict[str, Any]) -> None:
                results[key].append(line)
                if key == "b" and line.get("digest") == digest and line["completed"] < line["total"]:
                    follower_waiting.set()  # b follows a's download, which the gate holds

            await p.pull(name, report)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "a", "m")
                await stand_in.paused.setdefault(digest, trio.Event()).wait()
                assert list(p.statistics()) == [digest]  # a download in flight
                nursery.start_soon(run, "b", "other/m:alias")
                await follower_waiting.wait()
                stand_in.gate[digest].set()
    check_shape(results["a"])
    check_shape(results["b"])
    assert len(stand_in.blob_requests(digest)) == 1  # one download for both
    assert p.statistics() == {}
    store = o.OllamaStore(root)
    assert store.resolve("m").path == store.resolve("other/m:alias").path


async def test_a_follower_takes_over_when_the_download_owner_is_cancelled(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        digest = sha(gguf)
        stand_in.gate[digest] = trio.Event()
        p = puller(root, stand_in)
        follower_waiting = trio.Event()
        got: list[dict[str, Any]] = []

        async def owner() -> None:
            await collect(p, "m")

        async def follower() -> None:
            async def report(line: dict[str, Any]) -> None:
                got.append(line)
                if line.get("digest") == digest and line["completed"] < line["total"]:
                    follower_waiting.set()

            await p.pull("m", report)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                owner_scope = trio.CancelScope()

                async def owned() -> None:
                    with owner_scope:
                        await owner()

                nursery.start_soon(owned)
                await stand_in.paused.setdefault(digest, trio.Event()).wait()
                nursery.start_soon(follower)
                await follower_waiting.wait()
                del stand_in.gate[digest]  # the next request is served whole
                owner_scope.cancel(reason="the client went away")
    check_shape(got)
    assert content(o.OllamaStore(root).resolve("m").path) == gguf
    assert len(stand_in.blob_requests(digest)) == 2


async def test_pulled_models_are_served_and_deleted_by_the_stores(tmp_path: Path, gguf: bytes) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "local.gguf").write_bytes(gguf)
    stores = Stores(folder)
    assert stores.pull_root == folder / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf, template=TEMPLATE)
        stand_in.add_ollama_model("n", gguf + b"x", template=TEMPLATE)
        await collect(puller(folder / "pulled", stand_in), "m")
        await collect(puller(folder / "pulled", stand_in), "n")
    assert [s.name for s in stores.list()] == ["local:latest", "m:latest", "n:latest"]
    assert stores.resolve("m").path.startswith(str(folder / "pulled" / "blobs"))
    template_blob = folder / "pulled/blobs" / f"sha256-{hashlib.sha256(TEMPLATE.encode()).hexdigest()}"
    stores.delete("m")
    assert [s.name for s in stores.list()] == ["local:latest", "n:latest"]
    assert template_blob.exists()  # still named by n's manifest
    assert not (folder / "pulled/blobs" / f"sha256-{hashlib.sha256(gguf).hexdigest()}").exists()
    assert stores.copy("n", "n-copy") == "n-copy:latest"  # a second manifest, sharing n's blobs
    assert not (folder / "models.toml").exists()
    copied = folder / "pulled/manifests/registry.ollama.ai/library/n-copy/latest"
    assert copied.read_bytes() == (folder / "pulled/manifests/registry.ollama.ai/library/n/latest").read_bytes()
    stores.delete("n")
    assert [s.name for s in stores.list()] == ["local:latest", "n-copy:latest"]
    named = {x["digest"].replace(":", "-") for x in [*json.loads(copied.read_bytes())["layers"], json.loads(copied.read_bytes())["config"]]}
    assert {p.name for p in (folder / "pulled/blobs").iterdir()} == named
    assert f"sha256-{hashlib.sha256(gguf + b'x').hexdigest()}" in named


async def test_only_ollama_stores_means_nowhere_to_pull(tmp_path: Path) -> None:
    ollama = tmp_path / "ollama"
    (ollama / "manifests").mkdir(parents=True)
    (ollama / "blobs").mkdir()
    before = tree_snapshot(ollama)
    stores = Stores(ollama)
    assert stores.pull_root is None
    with pytest.raises(Forbidden, match=r"read-only Ollama store"):
        await Puller(stores.pull_root).prepare("m")
    assert tree_snapshot(ollama) == before


def test_errors_have_statuses() -> None:
    assert RegistryError("x").status == 502 and isinstance(RegistryError("x"), TrioshedError)
    assert InsufficientStorage(10, 1, "/x").status == 507
    assert json.loads(json.dumps(InsufficientStorage(10, 1, "/x").to_json()))["error"].startswith("not enough disk space")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (root only: mounting needs CAP_SYS_ADMIN), unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the injected free-space test covers the check")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the injected free-space test covers the check")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_really_small_disk_is_507(small_tmpfs: Path, gguf: bytes) -> None:
    root = small_tmpfs / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        with pytest.raises(InsufficientStorage, match=r"GB free"):
            await collect(puller(root, stand_in), "m")  # the real statvfs of a 1 MiB filesystem
    assert not any(small_tmpfs.iterdir())  # noqa: ASYNC240 - one directory read


async def test_a_disk_that_fills_during_the_download(tmp_path: Path, gguf: bytes) -> None:
    """The kernel's own ENOSPC (the partial file is /dev/full) stops the pull with a 507."""
    root = tmp_path / "pulled"
    digest = sha(gguf)
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest[7:]}-partial").symlink_to("/dev/full")
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        with pytest.raises(InsufficientStorage, match="not enough disk space"):
            await collect(puller(root, stand_in), "m")
    assert not (root / "manifests").exists()
    assert [p.name for p in (root / "blobs").iterdir()] == [f"sha256-{digest[7:]}-partial"]


async def test_insecure_reaches_a_names_own_registry_over_http(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("team/m:v1", gguf)
        host = stand_in.base_url.removeprefix("http://")
        p = Puller(root, registries=Registries(), backoff=0.0)  # the default registry is not involved
        with pytest.raises(RegistryError, match=rf"cannot reach https://{re.escape(host)}"):
            await p.prepare(f"{host}/team/m:v1")  # https to a plain-HTTP server: refused, nothing kept
        lines = await collect(p, f"{host}/team/m:v1", insecure=True)
    check_shape(lines)
    assert o.OllamaStore(root).resolve(f"{host}/team/m:v1").name == f"{host}/team/m:v1"
    assert (root / "manifests" / host / "team/m/v1").is_file()


async def test_a_blob_longer_than_its_manifest_says_keeps_nothing(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in() as stand_in:
        stand_in.add_ollama_model("m", gguf)
        stand_in.pad.add(sha(gguf))
        with pytest.raises(RegistryError, match=rf"sends {len(gguf) + 1024} bytes .* the manifest says {len(gguf)}"):
            await collect(puller(root, stand_in), "m")
    assert tree_snapshot(root) == {}  # the blobs folder, empty


async def test_a_server_without_range_support_starts_over(tmp_path: Path, gguf: bytes) -> None:
    root = tmp_path / "pulled"
    async with open_stand_in(StandIn(no_range=True)) as stand_in:
        stand_in.add_ollama_model("m", gguf)
        digest = sha(gguf)
        stand_in.cut[digest] = 5000
        lines = await collect(puller(root, stand_in), "m")
    check_shape(lines)
    assert [g.headers.get("range") for g in stand_in.blob_requests(digest)] == [None, "bytes=5000-"]
    assert content(o.OllamaStore(root).resolve("m").path) == gguf  # the 200 answer replaced the 5000 bytes
