"""How long ``trioshed serve`` takes from SIGTERM to its exit, in the states a restart meets.

``python -m bench.stop [--runs 5] [--out bench/results/DATE-stop.md]``

Each run starts ``python -m trioshed serve`` over tiny random models (``trioshed.testing.tiny``),
brings it to one state, sends SIGTERM and times the exit (``process.wait()``, wall clock: the
time a ``systemctl restart`` waits), with the log's own account of where the time went:

- **never loaded**: nothing was ever asked;
- **idle, 1 runner**: one request answered (a short prompt: no slot worth saving);
- **idle, 4 runners**: four models answered one request each;
- **slots to save**: one runner whose slot holds a long prompt (warm returns save it before the
  child stops: the bound is the save's own time, reported from trioshed's log);
- **stream in flight**: SIGTERM while a stream runs: it is drained (finishes) first; reported as
  the time from the stream's last byte to the exit.

Warm returns stay on (``TRIOSHED_KV_CACHE_BUDGET`` 4 GiB in a temporary folder), as a user has
them. The targets: < 1 s idle; the save time + 0.5 s when slots are worth saving.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path

import httpx
import trio

from bench.procs import RunnerFlags, open_trioshed
from trioshed.testing.tiny import write_tiny_model

FLAGS = RunnerFlags(threads=1, parallel=1, ctx_per_slot=1024)
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # ~350 tokens: one a byte


async def _generate(http: httpx.AsyncClient, model: str, prompt: str = "hi", n: int = 4) -> None:
    r = await http.post("/api/generate", json={"model": model, "prompt": prompt, "stream": False, "raw": True, "options": {"num_predict": n}})
    r.raise_for_status()


async def _never(http: httpx.AsyncClient) -> None:
    pass


async def _one(http: httpx.AsyncClient) -> None:
    await _generate(http, "tiny-0")


async def _four(http: httpx.AsyncClient) -> None:
    for i in range(4):
        await _generate(http, f"tiny-{i}")


async def _slots(http: httpx.AsyncClient) -> None:
    await _generate(http, "tiny-0", LONG_PROMPT)


SCENARIOS: dict[str, Callable[[httpx.AsyncClient], Awaitable[None]]] = {
    "never loaded": _never,
    "idle, 1 runner": _one,
    "idle, 4 runners": _four,
    "slots to save": _slots,
}


def _ms(log: str) -> float | None:
    """The save time trioshed logged ("warm returns: saved N tokens of M slot S (B bytes) in T ms")."""
    found = re.findall(r"warm returns: saved \d+ tokens .*? in (\d+) ms", log)
    return sum(float(t) for t in found) / 1000 if found else None


async def _run(models: Path, scenario: str, kv_dir: Path) -> dict[str, float | None]:
    env = {"TRIOSHED_KV_CACHE_DIR": str(kv_dir), "TRIOSHED_LOG_LEVEL": "info"}
    async with open_trioshed(models, FLAGS, kv_dir.parent / "logs", max_loaded=4, extra_env=env) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, trust_env=False) as http:
            stream_end = None
            if scenario == "stream in flight":
                await _generate(http, "tiny-0")
                body = {"model": "tiny-0", "prompt": "hi", "raw": True, "options": {"num_predict": 600}}
                async with http.stream("POST", "/api/generate", json=body) as response:
                    lines = response.aiter_lines()
                    await lines.__anext__()
                    sent = time.perf_counter()
                    server.process.send_signal(signal.SIGTERM)
                    async for _ in lines:
                        pass
                    stream_end = time.perf_counter()
            else:
                await SCENARIOS[scenario](http)
                await trio.sleep(0.5)  # idle: nothing in flight
                sent = time.perf_counter()
                server.process.send_signal(signal.SIGTERM)
            await server.process.wait()
            exited = time.perf_counter()
        log = server.log_path.read_text(errors="replace")
    return {
        "exit": exited - sent,
        "after stream": exited - stream_end if stream_end is not None else None,
        "saved": _ms(log),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=[*SCENARIOS, "stream in flight"], action="append")
    parser.add_argument("--out", type=Path, default=Path("bench/results") / f"{date.today():%Y-%m-%d}-stop.md")
    args = parser.parse_args()
    names = args.only or [*SCENARIOS, "stream in flight"]
    rows: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="trioshed-stop-") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        for i in range(4):
            write_tiny_model(models / f"tiny-{i}.gguf", context_length=4096, seed=i)
        for run in range(args.runs):
            for name in names:  # interleaved: the machine's noise spreads over every scenario
                kv = Path(tmp) / f"kv-{run}-{name.replace(' ', '-').replace(',', '')}"
                result = await _run(models, name, kv)
                rows[name].append(result)
                print(f"run {run + 1} {name}: {result}", file=sys.stderr, flush=True)
    lines = [
        "| state | SIGTERM to exit, median (s) | max (s) | runs | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, results in rows.items():
        exits = [r["exit"] or 0.0 for r in results]
        notes = []
        if name == "stream in flight":
            after = [r["after stream"] or 0.0 for r in results]
            notes.append(f"the stream ends first (drain); its last byte to exit: median {statistics.median(after):.2f} s, max {max(after):.2f} s")
        saves = [r["saved"] for r in results if r["saved"] is not None]
        if saves:
            notes.append(f"slot saves took median {statistics.median(saves) * 1000:.0f} ms")
        note = "; ".join(notes)
        lines.append(f"| {name} | {statistics.median(exits):.2f} | {max(exits):.2f} | {len(exits)} | {note} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"# SIGTERM to exit, {date.today():%Y-%m-%d}\n\n`python -m bench.stop --runs {args.runs}` on a shared 2-core machine.\n\n{table}\n")


if __name__ == "__main__":
    trio.run(main)
