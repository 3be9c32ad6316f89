"""The container image (``Containerfile``, ``make image``), built and run with this machine's engine.

``packaging/container/build.sh`` builds it as ``make image`` does (podman, else docker; the base
made from Debian's packages with mmdebstrap where no registry answers, and kept for the next
build). Then what is in it: the user, the entry point, the volumes, the layout, no build tools.
Then it runs as a pod runs it: a read-only root, ``/tmp`` a tmpfs, the demo model on a read-only
store volume, ``HOME`` a named volume. ``GET /`` answers, the demo model answers, and SIGTERM with
an answer streaming drains: the answer finishes, ``GET /`` says 503 meanwhile, and the container
exits 0 within the drain's bound.

Skipped, saying so, where no container engine is installed. ``.ci/run`` installs podman, buildah,
mmdebstrap and runc and sets ``TRIOSHED_TEST_NEEDS_CONTAINERS``, which makes that a failure.
Measured on two cores (load 2.5): with nothing cached, the base and the image built in 87 s and
the whole module ran in 103 s; with the base kept, the image built in 44 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.paths import REPO
from trioshed.testing.llama import free_port

ROOT = REPO
BUILD = ROOT / "packaging" / "container" / "build.sh"
ENGINE = os.environ.get("ENGINE") or shutil.which("podman") or shutil.which("docker")
IMAGE = "localhost/trioshed-test:latest"
#: What `trioshed serve` allows a drain by default: TRIOSHED_SHUTDOWN_TIMEOUT (10 s), the saved
#: slots' TRIOSHED_KV_SAVE_TIMEOUT (5 s) and the 2 s cut, with start-up slack.
DRAIN_BOUND = 20.0

if ENGINE is None and os.environ.get("TRIOSHED_TEST_NEEDS_CONTAINERS"):
    raise RuntimeError("CI: no container engine (apt-get install podman buildah mmdebstrap runc); the image test needs one")
needs_engine = pytest.mark.skipif(ENGINE is None, reason="no container engine here (apt-get install podman buildah mmdebstrap runc, or docker)")


def test_the_manifests_and_docs_run_the_image_make_image_builds() -> None:
    """Without an engine: the image the manifests name is the one ``make image`` tags, run as
    the Containerfile's user with its volumes, and the docs name the same command."""
    containerfile = (ROOT / "Containerfile").read_text()
    deployment = yaml.safe_load((ROOT / "packaging" / "kubernetes" / "deployment.yaml").read_text())
    kustomization = yaml.safe_load((ROOT / "packaging" / "kubernetes" / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert f"{image['newName']}:{image['newTag']}" == "trioshed:latest"
    assert "IMAGE=${IMAGE:-trioshed:latest}" in BUILD.read_text()
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == image["name"] and container["command"][0] == "trioshed"
    assert "USER 10001:10001" in containerfile and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/models", "/var/lib/trioshed", "/tmp"} <= mounts
    assert 'VOLUME ["/models", "/var/lib/trioshed"]' in containerfile
    assert "make image" in (ROOT / "docs" / "kubernetes.md").read_text()


def _run(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def image() -> Iterator[tuple[list[str], list[str]]]:
    """The image built (its tag is IMAGE), and the engine's global and per-container flags here."""
    assert ENGINE is not None
    env = {**os.environ, "ENGINE": ENGINE, "IMAGE": IMAGE}
    started = time.monotonic()
    build = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    print(f"image built in {time.monotonic() - started:.0f} s")
    flags = subprocess.run([str(BUILD), "flags"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=True)
    runtime, limits = [*flags.stdout.splitlines(), "", ""][:2]
    yield runtime.split(), limits.split()
    _run(ENGINE, "rmi", "-f", IMAGE, check=False)


@pytest.mark.slow
@needs_engine
def test_the_image_holds_trioshed_and_no_build_tools(image: tuple[list[str], list[str]]) -> None:
    assert ENGINE is not None
    runtime, limits = image
    (config,) = json.loads(_run(ENGINE, "image", "inspect", IMAGE).stdout)
    c = config["Config"]
    assert c["User"] == "10001:10001"
    assert c["Entrypoint"] == ["trioshed"] and c["Cmd"] == ["serve"]
    assert set(c["Volumes"]) == {"/models", "/var/lib/trioshed"}
    assert "11434/tcp" in c["ExposedPorts"]
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["TRIOSHED_HOST"] == "0.0.0.0:11434" and env["TRIOSHED_MODELS"] == "/models"
    assert env["HOME"] == "/var/lib/trioshed" and env["TRIOSHED_USAGE_DB"].startswith("/var/lib/trioshed/")
    script = (
        "set -e; id -u; id -g; command -v trioshed;"
        " for t in gcc cc c++ make ld pip pip3 uv git curl wget; do command -v $t && echo FOUND $t; done;"
        " ls /opt | tr '\\n' ' '; echo;"
        " test -w /opt/trioshed && echo WRITABLE /opt/trioshed; test -w /models && echo WRITABLE /models;"
        " python3 -c 'import sys, trioshed; print(sys.version_info[:2], trioshed.__file__)';"
        " python3 -m trioshed.runner.binary 2>/dev/null || true;"
        " cat /opt/trioshed/share/trioshed/llama-server.json"
    )
    out = _run(ENGINE, *runtime, "run", "--rm", *limits, "--read-only", "--entrypoint", "/bin/sh", IMAGE, "-c", script).stdout
    lines = out.splitlines()
    assert lines[:3] == ["10001", "10001", "/opt/trioshed/bin/trioshed"], out
    assert "FOUND" not in out and "WRITABLE" not in out, out  # no compiler, installer or fetcher; /opt is root's
    assert lines[3].split() == ["trioshed"], out  # the builder's uv is not there
    assert "/opt/trioshed/lib/python3.11/site-packages/trioshed/__init__.py" in out  # installed, not a source checkout
    marker = json.loads(out[out.index("{"):])
    assert marker["origin"] == "bundled" and marker["path"].startswith("/opt/trioshed/")


@pytest.mark.slow
@needs_engine
def test_the_image_serves_the_demo_model_read_only_and_drains_on_sigterm(
    image: tuple[list[str], list[str]], gemma_model: Path, tmp_path: Path
) -> None:
    assert ENGINE is not None
    runtime, limits = image
    store = tmp_path / "models"
    store.mkdir()
    try:
        os.link(gemma_model, store / "gemma3-270m.gguf")
    except OSError:
        shutil.copy(gemma_model, store / "gemma3-270m.gguf")
    store.chmod(0o755)
    name, volume, port = f"trioshed-test-{os.getpid()}", f"trioshed-test-home-{os.getpid()}", free_port()
    _run(ENGINE, "volume", "create", volume)
    try:
        _run(ENGINE, *runtime, "run", "-d", "--name", name, *limits, "--read-only", "--tmpfs", "/tmp",
             "-v", f"{store}:/models:ro", "-v", f"{volume}:/var/lib/trioshed", "-p", f"127.0.0.1:{port}:11434",
             IMAGE)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, _run(ENGINE, "logs", name, check=False).stderr[-3000:]
            time.sleep(0.2)
        body = {"model": "gemma3-270m", "prompt": "The three largest cities in France are", "stream": False,
                "options": {"temperature": 0, "num_predict": 8}}  # fmt: skip
        r = httpx.post(f"{base}/api/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 8 and r.json()["response"].strip()

        # SIGTERM while an answer streams: it finishes, GET / says the pod drains, the container ends.
        lines: list[dict[str, object]] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{base}/api/generate", timeout=120,
                              json={**body, "stream": True, "options": {"temperature": 0, "num_predict": 48}}) as s:  # fmt: skip
                for line in s.iter_lines():
                    if line:
                        lines.append(json.loads(line))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        stopped_at = time.monotonic()
        _run(ENGINE, "kill", "--signal", "TERM", name)
        try:
            draining = httpx.get(f"{base}/", timeout=5).status_code
        except httpx.TransportError:
            draining = 0  # the answer ended first and the server with it
        reader.join(60)
        waited = _run(ENGINE, "wait", name, timeout=DRAIN_BOUND + 30).stdout.strip()
        took = time.monotonic() - stopped_at
        logs = _run(ENGINE, "logs", name, check=False)
    finally:
        _run(ENGINE, "rm", "-f", name, check=False)
        _run(ENGINE, "volume", "rm", "-f", volume, check=False)
    assert lines and lines[-1].get("done") is True and lines[-1].get("eval_count") == 48, lines[-1:]
    assert draining in (503, 0)
    assert waited == "0", logs.stderr[-3000:]
    assert took < DRAIN_BOUND, took
    assert "trioshed stopped" in logs.stderr + logs.stdout
    assert "cannot be written" not in logs.stderr  # the usage database is on the HOME volume
