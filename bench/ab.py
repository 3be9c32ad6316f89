"""Two checkouts of trioshed side by side: per-request latency and process CPU, one run.

``python -m bench.ab --base PATH`` starts a direct ``llama-server`` and two trioshed servers over
the same tiny model and binary (this checkout, and the ``trioshed`` package of the checkout at
``PATH``, e.g. a ``git worktree`` of the commit before a change), warms each up, then sends
``--requests`` small requests (whole; streamed with ``--stream``) per target at c=1, the targets taking turns request by request so
that noise falls on all of them alike. It reports, per target and per request family (Ollama's
raw generate, OpenAI chat): the p50 and p90 latency, the paired overhead over direct (p50 of the
per-round differences), and the server process's own CPU time per request (psutil: user +
system of the trioshed process, its runner excluded), which is what a change to the request path
moves and what wall time on a shared 2-core machine hides. Rounds alternate which target goes
first. Written for judging refactors: a change meant to be behaviour-neutral should leave the
ratios at 1.00 within the spread of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import psutil
import trio

from bench.models import prepare_models
from bench.procs import RunnerFlags, open_direct, open_trioshed

MODEL = "tiny-s"
FLAGS = RunnerFlags(parallel=1)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def _bodies(target: str, n_predict: int, stream: bool = False) -> dict[str, tuple[str, dict[str, object]]]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": n_predict, "temperature": 0, "seed": 1, "stream": stream}  # fmt: skip
    if target == "direct":
        generate = ("/completion", {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "seed": 1, "stream": stream})
    else:
        generate = ("/api/generate", {"model": MODEL, "prompt": PROMPT, "raw": True, "stream": stream,
                                      "options": {"num_predict": n_predict, "temperature": 0, "seed": 1}})  # fmt: skip
    return {"generate": generate, "chat": ("/v1/chat/completions", chat)}


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def run(base: Path, requests: int, n_predict: int, stream: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    work = Path(tempfile.mkdtemp(prefix="trioshed-ab-"))
    models = prepare_models(work / "models", tiny=[MODEL])
    async with AsyncExitStack() as stack:
        servers = {
            "direct": await stack.enter_async_context(open_direct(MODEL, models[MODEL], FLAGS, work / "logs")),
            "this": await stack.enter_async_context(
                open_trioshed(work / "models", FLAGS, work / "logs", max_loaded=1, name="this")),
            "base": await stack.enter_async_context(
                open_trioshed(work / "models", FLAGS, work / "logs", max_loaded=1, source=base, name="base")),
        }  # fmt: skip
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        names = list(servers)
        bodies = {n: _bodies(n, n_predict, stream) for n in names}
        results: dict[str, dict[str, dict[str, float]]] = {}
        for family in ("generate", "chat"):
            for n in names:  # warm: the model loaded, connections open
                for _ in range(5):
                    path, body = bodies[n][family]
                    (await client.post(servers[n].base_url + path, json=body)).raise_for_status()
            took: dict[str, list[float]] = {n: [] for n in names}
            cpu0 = {n: _cpu(servers[n].process.pid) for n in names}
            for i in range(requests):
                order = names[i % len(names):] + names[: i % len(names)]
                for n in order:
                    path, body = bodies[n][family]
                    t0 = time.perf_counter()
                    r = await client.post(servers[n].base_url + path, json=body)
                    took[n].append(time.perf_counter() - t0)
                    r.raise_for_status()
            for n in names:
                cpu = _cpu(servers[n].process.pid) - cpu0[n]
                diffs = [a - d for a, d in zip(took[n], took["direct"], strict=True)]
                results.setdefault(n, {})[family] = {
                    "p50_ms": statistics.median(took[n]) * 1e3,
                    "p90_ms": statistics.quantiles(took[n], n=10)[-1] * 1e3,
                    "overhead_p50_ms": statistics.median(diffs) * 1e3,
                    "cpu_ms_per_request": cpu / requests * 1e3,
                }
        return results


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (its trioshed/ is imported)")
    p.add_argument("--requests", type=int, default=300, help="per target and family")
    p.add_argument("--n-predict", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="whole runs, to show the spread")
    p.add_argument("--stream", action="store_true", help="streamed answers (each read to its end), as make bench's overhead")
    args = p.parse_args()
    for i in range(args.repeat):
        res = trio.run(run, args.base.resolve(), args.requests, args.n_predict, args.stream)
        print(f"run {i + 1}: {args.requests} {'streamed ' if args.stream else ''}requests per target and family, n_predict {args.n_predict}")
        print("| family | target | p50 ms | p90 ms | overhead p50 ms | server CPU ms/request | CPU ratio this/base |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for family in ("generate", "chat"):
            for n in ("direct", "base", "this"):
                r = res[n][family]
                ratio = r["cpu_ms_per_request"] / res["base"][family]["cpu_ms_per_request"] if n == "this" else None
                print(f"| {family} | {n} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['overhead_p50_ms']:+.2f} | "
                      f"{r['cpu_ms_per_request']:.2f} | {'' if ratio is None else f'{ratio:.3f}'} |")  # fmt: skip


if __name__ == "__main__":
    main()
