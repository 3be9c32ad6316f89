"""The coding agents people run, unchanged, against a real trioshed: Claude Code (``claude -p``,
``/v1/messages``), Codex CLI (``codex exec``, ``/v1/responses``, as a configured provider and as
``--oss``, Ollama's way) and opencode (``opencode run``, ``/v1/chat/completions``).

Each completes a one-line task on the agent model (:mod:`trioshed.testing.agent_model`: every
byte a token, a 128k context, one answer then the end of its turn), with its real prompt: 25 to
45 thousand tokens of system prompt, tool schemas (Claude Code's ``Workflow`` with its
``maxLength`` of 524,288) and environment, non-ASCII text included, and Claude Code's
``role: "system"`` message inside ``messages``. Nothing is changed for trioshed: the model is
named as it is (no alias to a Claude or OpenAI model name), no tool is turned off. Each client
is kept off the network by its own switches (:mod:`trioshed.testing.agents`), and runs under
``strace``, which records every address it tries to reach: only the server's.

The clients come from npm at the versions ``tests/agents/package-lock.json`` pins, installed
once into ``~/.cache/trioshed-test/agents`` (about 1.2 GB: each ships a native binary; 30-60 s
with the registry reachable). Where npm, the registry or strace is missing they are skipped
with the reason, except under ``.ci/run`` (``TRIOSHED_TEST_NEEDS_AGENTS``), where they fail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import trio

from tests.support.models import GEMMA_CACHE_DIR
from trioshed.logs import JsonFormatter
from trioshed.testing.agent_model import AGENT_ANSWER, write_agent_model
from trioshed.testing.agents import AGENTS, agent_command, answer_of, outside_connections
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

PACKAGES = Path(__file__).parent.parent / "agents"
INSTALLED = GEMMA_CACHE_DIR / "agents"
NEEDED = bool(os.environ.get("TRIOSHED_TEST_NEEDS_AGENTS"))
#: What a user asks, non-ASCII included; the model answers AGENT_ANSWER to anything.
TASK = "Reply with one line — the words “Done ✓” and nothing else."


def _unavailable(why: str) -> None:
    if NEEDED:
        pytest.fail(f"{why} (required under .ci/run: TRIOSHED_TEST_NEEDS_AGENTS)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """``node_modules/.bin`` of the pinned clients, installed when the lock changed."""
    if not shutil.which("npm") or not shutil.which("node"):
        _unavailable("node and npm are not on PATH: the coding agents are installed from npm")
    if not shutil.which("strace"):
        _unavailable("strace is not installed: it shows whether an agent talks to anything but trioshed")
    wanted = b"".join((PACKAGES / name).read_bytes() for name in ("package.json", "package-lock.json"))
    stamp = INSTALLED / ".installed"
    bin_dir = INSTALLED / "node_modules" / ".bin"
    if not stamp.is_file() or stamp.read_text() != hashlib.sha256(wanted).hexdigest() or not bin_dir.is_dir():
        INSTALLED.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(PACKAGES / name, INSTALLED / name)
        # npm install, not npm ci: the lock holds only the platform packages the registry had when
        # it was made (opencode's others were missing), which npm ci would take for a stale lock
        try:
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=INSTALLED,
                                  capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            _unavailable("npm install of the coding agents took more than 15 minutes (registry unreachable?)")
        if done.returncode != 0:
            _unavailable(f"npm install of the coding agents failed (offline?): {done.stderr[-500:]}")
        stamp.write_text(hashlib.sha256(wanted).hexdigest())
    return bin_dir


def _requests(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in caplog.records if r.name == "trioshed.requests"]


@pytest.mark.parametrize("agent", list(AGENTS))
async def test_an_agent_completes_a_one_line_task(agent: str, agent_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "store"
    write_agent_model(store / "agent.gguf")
    caplog.set_level(logging.INFO, logger="trioshed.requests")
    trace = tmp_path / "strace.log"
    with trio.fail_after(240):
        async with open_test_server(store, log_format="json") as server:
            # Codex --oss checks /api/tags for the name exactly as given, tag and all
            command = agent_command(agent, bin_dir=agent_bin, home=tmp_path / "home", base_url=server.base_url,
                                    model="agent:latest" if agent == "codex-oss" else "agent", prompt=TASK)  # fmt: skip
            started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            done = await trio.run_process(
                ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace), *command.argv],
                env=command.env, cwd=command.cwd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
            took, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    requests = _requests(caplog)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"{agent}: exit {done.returncode} in {took:.1f} s, {cpu:.1f} s CPU (client), largest process so far {after.ru_maxrss // 1024} MB; requests: "
          + ", ".join(f"{r['method']} {r['route']} {r['status']} ({r['prompt_tokens']} prompt tokens)" for r in requests))  # fmt: skip
    assert done.returncode == 0, f"{AGENTS[agent]} failed:\n{stderr[-3000:]}\n{stdout[-1000:]}"
    assert answer_of(stdout) == AGENT_ANSWER, stdout[-1000:]
    generating = [r for r in requests if r["method"] == "POST"]
    assert generating and all(r["status"] == 200 for r in requests), requests
    route = {"claude": "/v1/messages", "codex": "/v1/responses", "codex-oss": "/v1/responses", "opencode": "/v1/chat/completions"}[agent]
    assert {r["route"] for r in generating} == {route}
    assert max(int(r["prompt_tokens"] or 0) for r in generating) > 20_000  # the agent's whole prompt, read
    if agent == "codex-oss":  # its Ollama checks, passed: the version (0.13.4 or newer) and the model's name
        assert [r["route"] for r in requests if str(r["route"]).startswith("/api/")] == ["/api/version", "/api/tags"]
    assert outside_connections(trace.read_text()) == [], "the client tried to reach the network"
