"""How slow a busy llama-server's ``/health`` gets, against how often it sends tokens.

The health monitor kills a runner only when it has neither answered a check nor sent output for
the check's timeout (3 s while a request waits, 10 s otherwise), twice in a row
(``trioshed.scheduler.lifetime``). This measures what that rule stands on: a tiny model with a
long context streams two answers on ``--threads`` threads while ``/health`` is asked every
0.2 s; printed: the health checks' median and worst latency, and the longest gap between two
tokens. Run: ``python -m bench.health_busy [--threads 4] [--seconds 15]`` (about 20 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from trioshed.models.tiny_gguf import write_tiny_model
from trioshed.runner.binary import find_llama_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(threads: int, seconds: float, folder: Path) -> dict[str, object]:
    model = write_tiny_model(folder / "long.gguf", context_length=131072, n_embd=256, n_layer=4)
    binary, port = find_llama_server(), _free_port()
    args = [binary.path, "-m", str(model), "-t", str(threads), "--port", str(port), "-c", "32768", "-np", "2", "-ngl", "0", "--fit", "off"]
    env = {**os.environ, **binary.env, "GGML_VK_VISIBLE_DEVICES": ""}
    base = f"http://127.0.0.1:{port}"
    with subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) as proc:
        try:
            _wait_ready(base)
            stop = time.monotonic() + seconds
            tokens: list[float] = []
            streams = [threading.Thread(target=_stream, args=(base, stop, tokens)) for _ in range(2)]
            for t in streams:
                t.start()
            time.sleep(1)
            latencies = []
            while time.monotonic() < stop - 0.5:
                started = time.monotonic()
                httpx.get(base + "/health", timeout=30)
                latencies.append(time.monotonic() - started)
                time.sleep(0.2)
            for t in streams:
                t.join()
        finally:
            proc.kill()
    arrived = sorted(tokens)
    gaps = [b - a for a, b in itertools.pairwise(arrived)]
    return {
        "threads": threads, "cpus": os.cpu_count(), "load_average": [round(x, 1) for x in os.getloadavg()],
        "health_checks": len(latencies), "health_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "health_max_ms": round(max(latencies) * 1000, 1), "tokens": len(tokens),
        "token_gap_max_ms": round(max(gaps) * 1000, 1),
    }  # fmt: skip


def _wait_ready(base: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("llama-server did not become ready")


def _stream(base: str, stop: float, tokens: list[float]) -> None:
    body = {"prompt": "hello", "n_predict": 1_000_000, "stream": True, "temperature": 1}
    with httpx.stream("POST", base + "/completion", json=body, timeout=None) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                tokens.append(time.monotonic())
            if time.monotonic() > stop:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4, help="llama-server threads (more than the cores: saturated)")
    parser.add_argument("--seconds", type=float, default=15.0)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(measure(opts.threads, opts.seconds, Path(folder))))


if __name__ == "__main__":
    main()
