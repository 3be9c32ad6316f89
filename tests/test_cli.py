"""The command line: client commands against a running trioshed, and serve's start-up errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]


async def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "trioshed", *args],
        capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


async def test_client_commands(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            listed = await cli("list", env=env)
            assert listed.returncode == 0 and b"tiny:latest" in listed.stdout
            ran = await cli("run", "tiny", "hello", env=env)
            assert ran.returncode == 0 and ran.stdout.strip() and not ran.stderr
            ps = await cli("ps", env=env)
            assert b"tiny:latest" in ps.stdout
            stopped = await cli("stop", "tiny", env=env)
            assert stopped.stdout.strip() == b"unload" and server.scheduler.statistics().runners == ()
            missing = await cli("run", "nope", "hi", env=env)
            assert missing.returncode == 1 and b"model 'nope' not found" in missing.stderr


async def test_the_usage_command(model_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-1"\ntokens_per_day = 1000000\n')
    with trio.fail_after(120):
        async with open_test_server(model_store, api_key="boss-secret-1", keys_file=keys, usage_db=tmp_path / "u.db") as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://"), "TRIOSHED_API_KEY": "ann-secret-1"}
            ran = await cli("run", "tiny", "hello", env=env)
            assert ran.returncode == 0
            table = (await cli("usage", env=env)).stdout.decode().splitlines()
            assert table[0].split("\t")[:4] == ["KEY", "MODEL", "START", "REQUESTS"]
            assert table[1].split("\t")[:2] == ["ann", "tiny:latest"] and table[1].split("\t")[3] == "1"
            prompt, completion = int(table[1].split("\t")[4]), int(table[1].split("\t")[6])
            assert table[3:] == ["KEY\tBUDGET\tLIMIT\tLEFT", f"ann\ttokens_per_day\t1000000\t{1000000 - prompt - completion}"]
            csv = (await cli("usage", "--csv", "--by", "hour", env=env)).stdout.decode().splitlines()
            assert csv[0] == "key,model,start,requests,prompt_tokens,cached_tokens,completion_tokens,errors,seconds"
            refused = await cli("usage", "--key", "default", env=env)
            assert refused.returncode == 1 and b"may read its own usage only" in refused.stderr


async def test_serve_without_a_runner_binary_exits_1_with_advice(tmp_path: Path) -> None:
    with trio.fail_after(60):
        result = await cli("serve", "--models", str(tmp_path), env={"TRIOSHED_LLAMA_SERVER": "/nonexistent/llama-server"})
    assert result.returncode == 1 and b"TRIOSHED_LLAMA_SERVER" in result.stderr


async def test_bad_settings_exit_2_naming_the_variable() -> None:
    with trio.fail_after(60):
        result = await cli("ps", env={"TRIOSHED_MAX_QUEUE": "lots"})
    assert result.returncode == 2 and b"TRIOSHED_MAX_QUEUE" in result.stderr


async def test_serve_refuses_a_public_rpc_server(tmp_path: Path) -> None:
    with trio.fail_after(60):
        result = await cli("serve", "--models", str(tmp_path), env={"TRIOSHED_RPC_SERVERS": "127.0.0.1:50052,8.8.8.8:50052"})
    assert result.returncode == 2, result.stderr
    assert b"8.8.8.8:50052 is at a public address" in result.stderr and b"TRIOSHED_RPC_ALLOW_PUBLIC" in result.stderr
