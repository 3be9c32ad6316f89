"""A large blob upload (``POST /api/blobs/<digest>``, what ``ollama create`` does with a local GGUF)
through a real ``trioshed serve`` on loopback: the server's memory and its other requests.

``python -m bench.upload [--size 1G] [--out FILE]``

The body is a sparse file of zeros (``--size``, e.g. ``1G``, ``20G``: nothing is written on the
client's side; the server writes it all), its sha256 computed first. ``curl -T`` sends it (with
its Content-Length, as the official clients do) from its own process, so that the uploader's work
does not share this process's event loop. Meanwhile:

- the RSS of the server's process (psutil) is sampled every 20 ms: the growth is the peak during
  the upload less the RSS just before it (after one small upload, so that nothing is imported
  for the first time during the measured one);
- ``GET /api/version`` is sent every 10 ms on one keep-alive connection: its latency's p50, p99
  and max during the upload, against the same poll for 2 s before it.

Targets: RSS growth <= 64 MiB, the other request's p99 < 20 ms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import trio

from bench.procs import RunnerFlags, open_trioshed

MiB = 1 << 20
TARGET_RSS = 64 * MiB
TARGET_P99 = 0.020


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sparse_file(path: Path, size: int) -> str:
    """A sparse file of ``size`` zeros; its ``sha256:<hex>``."""
    with open(path, "wb") as f:
        f.truncate(size)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


@dataclass
class Result:
    size: int
    seconds: float
    status: int
    rss_before: int
    rss_peak: int
    idle: list[float]
    during: list[float]

    @property
    def growth(self) -> int:
        return self.rss_peak - self.rss_before


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _poll(base_url: str, out: list[float], stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            (await http.get("/api/version")).raise_for_status()
            out.append(time.perf_counter() - t0)
            await trio.sleep(max(0.0, 0.010 - (time.perf_counter() - t0)))


async def _sample_rss(pid: int, peak: list[int], stop: trio.Event) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        await trio.sleep(0.02)


async def _curl_upload(base_url: str, digest: str, path: Path) -> int:
    done = await trio.run_process(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-T", str(path), "-X", "POST",
         "-H", "Expect:", f"{base_url}/api/blobs/{digest}"],
        capture_stdout=True, check=True,
    )  # fmt: skip
    return int(done.stdout.decode())


async def measure(size: int, work: Path) -> Result:
    models = work / "models"
    models.mkdir()
    body = work / "upload.bin"
    print(f"hashing a {size / 2**30:.1f} GiB sparse file ...", file=sys.stderr)
    digest = await trio.to_thread.run_sync(sparse_file, body, size)
    warm = work / "warm.bin"
    warm_digest = await trio.to_thread.run_sync(sparse_file, warm, 8 * MiB)
    async with open_trioshed(models, RunnerFlags(threads=1, parallel=1, ctx_per_slot=512), work, max_loaded=1) as server:
        assert await _curl_upload(server.base_url, warm_digest, warm) == 201
        idle: list[float] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_poll, server.base_url, idle, stop)
            await trio.sleep(2)
            stop.set()
        rss_before = psutil.Process(server.process.pid).memory_info().rss
        peak = [rss_before]
        during: list[float] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_sample_rss, server.process.pid, peak, stop)
            nursery.start_soon(_poll, server.base_url, during, stop)
            t0 = time.perf_counter()
            status = await _curl_upload(server.base_url, digest, body)
            seconds = time.perf_counter() - t0
            stop.set()
        stored = models / "pulled" / "blobs" / f"sha256-{digest[7:]}"
        if status != 201 or stored.stat().st_size != size:
            raise RuntimeError(f"the upload answered {status}; stored {stored.stat().st_size if stored.exists() else 0} bytes")
        await trio.to_thread.run_sync(stored.unlink)
    return Result(size, seconds, status, rss_before, peak[0], idle, during)


def report(r: Result) -> str:
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    rows = [
        ("upload", f"{r.size / 2**30:.1f} GiB in {r.seconds:.1f} s ({r.size / r.seconds / 2**20:.0f} MiB/s), answered {r.status}"),
        ("server RSS before", f"{r.rss_before / MiB:.0f} MiB"),
        ("server RSS peak during", f"{r.rss_peak / MiB:.0f} MiB"),
        ("RSS growth", f"{r.growth / MiB:.1f} MiB (target <= {TARGET_RSS // MiB} MiB)"),
        ("GET /api/version idle: p50 / p99 / max", f"{ms(statistics.median(r.idle))} / {ms(_pct(r.idle, 0.99))} / {ms(max(r.idle))} ({len(r.idle)} requests)"),
        ("GET /api/version during: p50 / p99 / max", f"{ms(statistics.median(r.during))} / {ms(_pct(r.during, 0.99))} / {ms(max(r.during))} ({len(r.during)} requests; target p99 < 20 ms)"),
    ]
    lines = ["| | |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)]
    load = os.getloadavg()
    lines.append(f"\nload average at the end: {load[0]:.2f} ({os.cpu_count()} CPUs)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="upload size, e.g. 1G or 20G (a sparse file)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one; needs room for the upload)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="trioshed-upload-") as tmp:
        result = trio.run(measure, parse_size(args.size), Path(tmp))
    text = report(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if result.growth > TARGET_RSS or _pct(result.during, 0.99) >= TARGET_P99:
        sys.exit(1)


if __name__ == "__main__":
    main()
