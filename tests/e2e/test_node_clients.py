"""JavaScript clients against trioshed: the ``ollama`` npm library and the Vercel AI SDK's
``ollama-ai-provider-v2`` (versions pinned in ``tests/node/package.json``).

Needs ``node`` and ``npm``; the packages are installed once into
``~/.cache/trioshed-test/node-clients`` (about 30 MB, 3 s with the registry reachable). Skipped,
with the reason, where node/npm are missing or the install fails (offline).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.models import GEMMA_CACHE_DIR
from tests.support.paths import REPO
from trioshed.testing.ollama_store import add_ollama_model
from trioshed.testing.registry import open_stand_in
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

HERE = REPO / "tests" / "node"
NODE_DIR = GEMMA_CACHE_DIR / "node-clients"


@pytest.fixture(scope="session")
def node_clients() -> Path:
    """The folder holding clients.mjs and its node_modules, installed when package.json changed."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are not on PATH: the JavaScript client checks (ollama npm, ollama-ai-provider-v2) need them")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    wanted = (HERE / "package.json").read_text()
    stamp = NODE_DIR / ".installed"
    if not stamp.is_file() or stamp.read_text() != wanted or not (NODE_DIR / "node_modules").is_dir():
        (NODE_DIR / "package.json").write_text(wanted)
        try:
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--no-package-lock"],
                cwd=NODE_DIR, capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.skip("npm install of the JavaScript clients timed out (registry unreachable?)")
        if done.returncode != 0:
            pytest.skip(f"npm install of the JavaScript clients failed (offline?): {done.stderr[-300:]}")
        stamp.write_text(wanted)
    shutil.copyfile(HERE / "clients.mjs", NODE_DIR / "clients.mjs")
    return NODE_DIR


async def run_clients(folder: Path, base_url: str, model: str, store_model: str) -> dict[str, Any]:
    done = await trio.run_process(
        ["node", str(folder / "clients.mjs"), base_url, model, store_model],
        capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


async def test_javascript_clients(node_clients: Path, model_store: Path, tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "short" stops by itself: the Vercel provider's generate sends no option trioshed (or Ollama) reads as a limit
    (model_store / "models.toml").write_text('[models.short]\npath = "tiny.gguf"\noptions = { num_predict = 8 }\n')
    ollama_root = tmp_path / "ollama"
    add_ollama_model(ollama_root, "llama3.2:1b", tiny_model, template="{{ .Tools }}{{ .Prompt }}")
    with trio.fail_after(120):
        async with open_stand_in() as registry:
            registry.add_ollama_model("llama3.2", await trio.to_thread.run_sync(tiny_model.read_bytes))
            monkeypatch.setenv("TRIOSHED_OLLAMA_REGISTRY", registry.base_url)
            async with open_test_server(f"{model_store}{os.pathsep}{ollama_root}") as server:  # type: ignore[arg-type]
                out = await run_clients(node_clients, server.base_url, "short", "llama3.2:1b")
    print(json.dumps(out, indent=1))
    # the ollama npm library
    assert out["list"]["ok"] == ["llama3.2:1b", "short:latest", "tiny:latest"]
    assert out["show"]["ok"] == ["completion", "tools"]
    assert out["generate"]["ok"]["done"] is True and out["generate"]["ok"]["eval_count"] == 4
    # Ollama's logprobs (the npm library's Logprob type), whole and streamed
    whole = out["generate_logprobs"]["ok"]
    assert "".join(e["token"] for e in whole["logprobs"]) == whole["response"] and len(whole["logprobs"]) == 4
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in whole["logprobs"])
    streamed = out["chat_logprobs_stream"]["ok"]
    assert streamed["logprobs"] and "".join(e["token"] for e in streamed["logprobs"]) == streamed["text"]
    assert all(len(e["top_logprobs"]) == 1 and isinstance(e["bytes"], list) for e in streamed["logprobs"])
    assert out["ps"]["ok"] == ["short:latest"]
    assert out["copy"]["ok"] == "success" and out["delete"]["ok"] == "success"
    assert out["pull"]["ok"] == "success"  # pulled from the registry stand-in
    assert out["create"]["ok"]["last"] == ["writing manifest", "success"]
    assert out["create"]["ok"]["system"] == "Be brief." and "512" in out["create"]["ok"]["parameters"]
    assert out["create_bad"]["status"] == 400 and "num_ctx" in out["create_bad"]["error"]
    assert out["push"]["ok"] == "success" and ("me", "node-made", "latest") in registry.manifests  # pushed to the stand-in
    assert out["create_delete"]["ok"] == "success"
    # ollama-ai-provider-v2: non-streamed generate validates the answer, which needs "context"
    assert "error" not in out["vercel_generate"], out["vercel_generate"]
    assert out["vercel_generate"]["ok"]["outputTokens"] == 8
    # Streamed, the provider requires "context" on every chunk, while Ollama (and trioshed) send it
    # only on the last one: it drops the others ("Failed to parse NDJSON line"), so its text is
    # empty with Ollama too. The last chunk passes: the stream finishes with "stop", not "other".
    assert out["vercel_generate_stream"]["ok"]["finishReason"] == "stop"
    assert out["vercel_chat"]["ok"]["outputTokens"] == 5  # providerOptions.ollama.options.num_predict
