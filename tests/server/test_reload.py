"""SIGHUP re-reads models.toml: runners whose model did not change keep serving, changed ones go."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.serve_process import serve_process
from trioshed.core.adapters import runner_model
from trioshed.core.model import ModelSpec
from trioshed.errors import ModelNotFound
from trioshed.reload import stale

FAST = {"num_predict": 2}


def test_stale_is_what_no_longer_resolves_to_itself() -> None:
    a, b, c = ModelSpec("a:latest", "/a"), ModelSpec("b:latest", "/b"), ModelSpec("c:latest", "/c")
    now = {"a:latest": a, "b:latest": ModelSpec("b:latest", "/b", defaults=(("num_ctx", 8),))}

    def resolve(name: str) -> ModelSpec:
        if name not in now:
            raise ModelNotFound(name)
        return now[name]

    assert stale([a, b, c], resolve) == [b, c]


def test_a_reload_keeps_a_group_s_runner_while_its_models_resolve_to_it() -> None:
    a1 = ModelSpec("a1:latest", "/m/base.gguf", adapters=("/m/l1.gguf",), group=("/m/l1.gguf", "/m/l2.gguf"))
    runner = runner_model(a1)
    assert stale([runner], lambda name: a1) == []
    assert stale([runner], lambda name: replace(a1, group=("/m/l1.gguf", "/m/l2.gguf", "/m/l4.gguf"))) == []  # grown: served by a larger one on demand
    assert stale([runner], lambda name: replace(a1, adapters=("/m/l9.gguf",), group=("/m/l9.gguf",))) == [runner]
    assert stale([runner], lambda name: replace(a1, args=("--jinja",))) == [runner]


TOML = """\
[models.steady]
path = "tiny.gguf"

[models.tuned]
path = "other.gguf"
options = {{ num_ctx = {ctx} }}
"""


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_sighup_keeps_unchanged_runners_and_replaces_changed_ones(model_store: Path) -> None:
    add_tiny(model_store, "other")
    toml = model_store / "models.toml"
    await trio.Path(toml).write_text(TOML.format(ctx=512))
    with trio.fail_after(90):
        async with serve_process(model_store) as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            for model in ("steady", "tuned"):
                r = await http.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False, "options": FAST})
                assert r.status_code == 200
            before = {m["name"]: m for m in (await http.get("/api/ps")).json()["models"]}
            assert before["tuned:latest"]["context_length"] == 512
            pids = set(served.runner_pids())
            assert len(pids) == 2
            await trio.Path(toml).write_text(TOML.format(ctx=1024))
            served.process.send_signal(signal.SIGHUP)
            with trio.fail_after(20):
                while True:
                    ps = {m["name"] for m in (await http.get("/api/ps")).json()["models"]}
                    if ps == {"steady:latest"}:
                        break
                    await trio.sleep(0.05)
            assert len(set(served.runner_pids()) & pids) == 1  # steady's runner, untouched
            r = await http.post("/api/generate", json={"model": "tuned", "prompt": "hi", "stream": False, "options": FAST})
            assert r.status_code == 200
            after = {m["name"]: m for m in (await http.get("/api/ps")).json()["models"]}
            assert after["tuned:latest"]["context_length"] == 1024
            assert "models.toml reloaded: 1 runner(s) kept, unloaded tuned:latest" in served.log()
            assert served.process.poll() is None  # SIGHUP does not end the server
