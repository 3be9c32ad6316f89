"""One model across "machines" on loopback: two real ``rpc-server`` processes (CPU backend, one
thread each) on 127.0.0.1 and a declared local GPU too small for the model.

What is real and what is declared: the local "GPU" (TRIOSHED_DEVICES) is only accounted, so the
layers planned on it run on this machine's CPU (llama-server gets no local ``--device``); the RPC
servers are real ggml backends in other processes, reached over TCP: llama-server is started with
``--rpc A,B --device RPC0,RPC1 --tensor-split <their layer counts> -ngl <their layers>``, and its
own log shows model, KV and compute buffers allocated on each of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.config_values import parse_rpc_servers
from trioshed.core.model import Device, MemoryEstimate, RunnerOptions
from trioshed.models.store import ModelStore
from trioshed.runner.binary import BinaryNotFound
from trioshed.server import estimate_model
from trioshed.testing.rpc import RpcServerProcess, rpc_servers
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

CTX = 512
SHAPE = {"n_embd": 256, "n_layer": 8, "seed": 7}  # ~2.5 MiB of F32 weights per layer


@pytest.fixture
def two_rpc_servers() -> Iterator[list[RpcServerProcess]]:
    try:
        with rpc_servers(2, threads=1) as servers:
            yield servers
    except BinaryNotFound as exc:
        pytest.skip(f"no llama.cpp rpc-server binary: {exc}")


def _flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}


async def _generate(http: httpx.AsyncClient, **options: object) -> httpx.Response:
    body = {"model": "big", "prompt": "hi", "stream": False, "options": {"num_predict": 4, "temperature": 0, **options}}
    return await http.post("/api/generate", json=body)


def _too_big_locally(
    tmp_path: Path, a: RpcServerProcess, b: RpcServerProcess
) -> tuple[Path, Device, Any, MemoryEstimate, int]:
    """A store with "big" and an inventory where it fits only across both servers: local room
    for 2 layers, each server room for 4 (declared caps: the servers report this machine's
    whole RAM). 9 layers (8 + output) -> 2 local, 4 on A, 3 on B."""
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "big", **SHAPE)
    # beside RPC servers trioshed's automatic choice is flash attention off (a server's backend
    # may lack the kernel): the options the server estimates with (checked in its argv below)
    est = estimate_model(ModelStore(store).resolve("big"), RunnerOptions(num_ctx=CTX, num_thread=1, flash_attention=False))
    layer = max(est.layers)
    local = est.compute_full + 2 * layer + layer // 2
    remote = est.compute_full + 4 * layer + layer // 2
    gpu = Device("cuda:0", "cuda", 0, local, local, name="declared cuda:0")
    return store, gpu, parse_rpc_servers(f"{a.address}={remote},{b.address}={remote}"), est, remote


async def test_a_model_too_big_locally_runs_across_two_rpc_servers_and_survives_losing_one(
    tmp_path: Path, two_rpc_servers: list[RpcServerProcess]
) -> None:
    a, b = two_rpc_servers
    store, gpu, servers, est, remote = _too_big_locally(tmp_path, a, b)
    with trio.fail_after(180):
        async with open_test_server(
            store, devices=(gpu,), rpc_servers=servers, context_length=CTX
        ) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            stats = server.scheduler.statistics()
            assert [(s.address, s.up, s.total, s.source) for s in stats.remote] == [
                (a.address, True, remote, "reported, capped"),
                (b.address, True, remote, "reported, capped"),
            ]

            # 1. it loads across local + both servers, and answers
            response = await _generate(http)
            assert response.status_code == 200, response.text
            assert response.json()["done"] is True
            (runner,) = server.scheduler.statistics().runners
            placement = runner.placement
            assert placement.devices == ("cuda:0", f"rpc:{a.address}", f"rpc:{b.address}")
            assert placement.layers == (2, 4, 3) and placement.n_gpu_layers == 9
            assert runner.pid is not None
            argv = psutil.Process(runner.pid).cmdline()
            flags = _flags(argv)
            assert flags["--rpc"] == f"{a.address},{b.address}"
            assert flags["--device"] == "RPC0,RPC1" and flags["--tensor-split"] == "4,3"
            assert flags["--n-gpu-layers"] == "7"  # the servers' share; the declared GPU's runs on the CPU
            assert flags["--flash-attn"] == "off"  # automatic beside RPC servers: as estimated
            # llama.cpp itself allocated weights on both servers (its buffer report, parsed)
            assert runner.measured is not None
            on_server = {
                addr: sum(v for k, v in runner.measured.model.items() if addr in k) for addr in (a.address, b.address)
            }
            # exactly the planned layers: 4 repeating layers on A; 2 and the output layer on B
            per_layer = est.weights / len(est.layers)
            assert abs(on_server[a.address] - 4 * per_layer) < 0.02 * per_layer, runner.measured.model
            assert abs(on_server[b.address] - (2 * per_layer + est.output)) < 0.02 * per_layer, runner.measured.model

            ps = (await http.get("/api/ps")).json()
            assert ps["models"][0]["rpc_servers"] == [a.address, b.address]
            assert [(s["address"], s["state"], s["model"]) for s in ps["rpc_servers"]] == [
                (a.address, "up", "big:latest"),
                (b.address, "up", "big:latest"),
            ]
            assert all(s["used"] > 0 for s in ps["rpc_servers"])
            metrics = (await http.get("/metrics")).text
            assert f'trioshed_rpc_server_up{{endpoint="{b.address}"}} 1' in metrics

            # 2. an RPC server dies mid-stream: the stream ends with an error naming it
            body = {"model": "big", "prompt": "hello", "options": {"num_predict": 100000, "temperature": 1}}
            async with http.stream("POST", "/api/generate", json=body) as stream:
                lines = stream.aiter_lines()
                assert json.loads(await lines.__anext__())["done"] is False
                b.kill()
                rest = [json.loads(line) async for line in lines if line]
            assert "error" in rest[-1] and not any(c.get("done") for c in rest), rest[-3:]
            error = rest[-1]["error"]
            assert f"RPC server {b.address}" in error and "stopped answering" in error, error
            stats = await server.scheduler.wait_statistics(lambda s: s.leased == 0 and not s.runners)
            assert stats.crashes == 1
            down = {s.address: s for s in stats.remote}
            assert down[b.address].up is False and down[a.address].up is True
            ps = (await http.get("/api/ps")).json()
            assert [s["state"] for s in ps["rpc_servers"]] == ["up", "down"]

            # 3. all 9 layers on accelerators need B: 503 naming it
            response = await _generate(http, num_gpu=9)
            assert response.status_code == 503, response.text
            assert b.address in response.json()["error"] and "Retry-After" in response.headers

            # 4. automatic placement replaces the runner without B: local GPU, A, the rest on the CPU
            response = await _generate(http)
            assert response.status_code == 200, response.text
            (runner,) = server.scheduler.statistics().runners
            assert runner.placement.endpoints == (a.address,)
            assert runner.placement.layers == (2, 5) and runner.placement.n_gpu_layers == 7  # 4 + output on A

            # 5. B comes back: it is used again once it answers
            b.restart()
            await server.scheduler.wait_statistics(lambda s: all(r.up for r in s.remote))
            response = await _generate(http, num_gpu=9)
            assert response.status_code == 200, response.text
            (runner,) = server.scheduler.statistics().runners
            assert runner.placement.endpoints == (a.address, b.address)


async def test_a_server_gone_before_the_load_is_left_out_without_a_back_off(
    tmp_path: Path, two_rpc_servers: list[RpcServerProcess]
) -> None:
    a, b = two_rpc_servers
    store, gpu, servers, _, _ = _too_big_locally(tmp_path, a, b)
    with trio.fail_after(120):
        async with open_test_server(
            store, devices=(gpu,), rpc_servers=servers, context_length=CTX
        ) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            assert all(s.up for s in server.scheduler.statistics().remote)
            b.kill()  # trioshed still believes B is up: the first load uses it and fails
            response = await _generate(http)
            assert response.status_code == 200, response.text
            stats = server.scheduler.statistics()
            assert stats.load_failures == 1 and stats.loads == 2
            (runner,) = stats.runners
            assert runner.placement.endpoints == (a.address,) and not runner.options.flash_attention
            assert {s.address: s.up for s in stats.remote} == {a.address: True, b.address: False}


@pytest.mark.parametrize("ngl", [1, 4, 8, 9])
def test_split_layers_matches_the_pinned_llama_cpp(
    tmp_path: Path, two_rpc_servers: list[RpcServerProcess], ngl: int
) -> None:
    """An RPC server is a real offload device on a machine without GPUs: the weights llama.cpp
    puts on each of two servers for ``-ngl`` and a tensor split are the layers split_layers says."""
    from trioshed.core.placement import split_layers
    from trioshed.runner.memlog import parse_memory_log
    from trioshed.testing.llama import running_llama_server

    a, b = two_rpc_servers
    model = add_tiny(tmp_path, "big", **SHAPE)
    est = estimate_model(ModelStore(tmp_path).resolve("big"), RunnerOptions(num_ctx=CTX, num_thread=1))
    per_layer = est.weights / len(est.layers)
    split = [3.0, 2.0]
    args = [
        "--rpc", f"{a.address},{b.address}", "--device", "RPC0,RPC1", "--tensor-split", "3,2",
        "-ngl", str(ngl), "--fit", "off", "-t", "1", "-c", str(CTX), "--log-verbosity", "4",
    ]  # fmt: skip
    with running_llama_server(model, args) as server:
        pass
    measured = parse_memory_log(server.final_log or "")
    assert measured is not None
    predicted = split_layers(len(est.layers), ngl, split)
    for addr, layers in zip((a.address, b.address), predicted, strict=True):
        expected = sum(est.output if il == len(est.layers) else per_layer for il in layers)
        real = sum(v for k, v in measured.model.items() if addr in k)
        assert abs(real - expected) < 0.02 * per_layer, (ngl, addr, layers, measured.model)
