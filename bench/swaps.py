"""Swap-aware dispatch: strict arrival order (``TRIOSHED_MAX_EXTRA_WAIT=0``, Ollama's
policy) against the default, side by side in one session, real ``llama-server`` children (one
thread each), trioshed served in-process.

Scenarios (each run in both modes, modes alternating):

- ``burst``: 24 requests at once cycling over 3 tiny models, room for one runner with 2 slots
  (the issue's example; the minimum is 3 loads);
- ``steady``: 8 clients, each sending 6 requests one after another, models drawn (seeded) from
  3 tiny models and Gemma 3 270M, room for two runners with 2 slots;
- ``flood``: tenants by model: A floods ``tiny-s`` with 12 clients back to back, B sends one
  ``tiny-m`` request every 0.5 s (12 in all), room for one runner with 2 slots. Reported: B's
  p99 (the tenant being flooded out);
- ``tenants``: the same flood, both on ``tiny-s``, A and B with their own API keys (keys file;
  "strict" runs without keys: one queue in arrival order, as Ollama). Fair shares, not swaps.

Reported per scenario and mode: loads, total seconds, p50/p99 latency (seconds, end to end), and
B's p99 for ``flood``. Run: ``python -m bench.swaps [--rounds 1] [--out FILE.md]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = {"strict (0)": 0.0, "default (5 s)": 5.0}  # tenants: strict also runs without keys


def pct(values: list[float], q: float) -> float:
    from bench.stats import percentile

    return percentile(values, q) or 0.0


KEYS = '[[key]]\nname = "a"\nkey = "tenant-a-key"\n\n[[key]]\nname = "b"\nkey = "tenant-b-key"\n'


async def run_scenario(name: str, folder: Path, bound: float) -> dict[str, Any]:
    import httpx
    import trio

    from trioshed.testing.server import open_test_server

    max_loaded = 2 if name == "steady" else 1
    lat: list[float] = []
    tenant_b: list[float] = []
    keyed = name == "tenants" and bound > 0
    extra: dict[str, Any] = {}
    if keyed:
        (folder.parent / "keys.toml").write_text(KEYS)
        extra["keys_file"] = folder.parent / "keys.toml"
    async with (
        open_test_server(folder, max_loaded_models=max_loaded, num_parallel=2, context_length=512,
                         max_extra_wait=bound, max_queue=256, **extra) as server,  # fmt: skip
        httpx.AsyncClient(base_url=server.base_url, timeout=600) as http,
    ):

        async def ask(model: str, into: list[float] | None = None) -> None:
            body = {"model": model, "prompt": "Once upon a time", "raw": True, "stream": False,
                    "options": {"num_predict": 8, "temperature": 0, "seed": 1}}  # fmt: skip
            tenant = "b" if into is not None else "a"
            headers = {"Authorization": f"Bearer tenant-{tenant}-key"} if keyed else {}
            t0 = time.perf_counter()
            r = await http.post("/api/generate", json=body, headers=headers)
            r.raise_for_status()
            took = time.perf_counter() - t0
            lat.append(took)
            if into is not None:
                into.append(took)

        t_start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            if name == "burst":
                for i in range(24):
                    nursery.start_soon(ask, ("tiny-s", "tiny-m", "tiny-l")[i % 3])
            elif name == "steady":
                rng = random.Random(17)
                plans = [[rng.choice(("tiny-s", "tiny-m", "tiny-l", "gemma3")) for _ in range(6)] for _ in range(8)]

                async def client(models: list[str]) -> None:
                    for m in models:
                        await ask(m)

                for p in plans:
                    nursery.start_soon(client, p)
            else:
                done = trio.Event()

                b_model = "tiny-s" if name == "tenants" else "tiny-m"

                async def flooder() -> None:
                    while not done.is_set():
                        await ask("tiny-s")

                async def tenant() -> None:
                    async with trio.open_nursery() as inner:
                        for _ in range(12):
                            inner.start_soon(ask, b_model, tenant_b)
                            await trio.sleep(0.5)
                    done.set()

                for _ in range(12):
                    nursery.start_soon(flooder)
                nursery.start_soon(tenant)
        total = time.perf_counter() - t_start
        stats = server.scheduler.statistics()
    result: dict[str, Any] = {
        "requests": len(lat), "loads": stats.loads, "total_s": round(total, 2),
        "p50_s": round(pct(lat, 50), 3), "p99_s": round(pct(lat, 99), 3),
    }  # fmt: skip
    if tenant_b:
        result["b_p99_s"] = round(pct(tenant_b, 99), 3)
    return result


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = [
        "| scenario | mode | requests | loads | total s | p50 s | p99 s | B's p99 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scenario, modes in results.items():
        for mode, runs in modes.items():
            for r in runs:
                lines.append(f"| {scenario} | {mode} | {r['requests']} | {r['loads']} | {r['total_s']} | {r['p50_s']} | "
                             f"{r['p99_s']} | {r.get('b_p99_s', '-')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import trio

    from bench.models import prepare_models

    p = argparse.ArgumentParser(prog="python -m bench.swaps", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--scenarios", default="burst,steady,flood,tenants")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="trioshed-swaps-") as tmp:
        folder = Path(tmp) / "models"
        scenarios = args.scenarios.split(",")
        prepare_models(folder, gemma="steady" in scenarios)
        for scenario in scenarios:
            results[scenario] = {m: [] for m in MODES}
            for rnd in range(args.rounds):
                order = list(MODES.items()) if rnd % 2 == 0 else list(reversed(MODES.items()))
                for mode, bound in order:
                    r = trio.run(run_scenario, scenario, folder, bound)
                    print(f"{scenario} {mode}: {json.dumps(r)}", file=sys.stderr)
                    results[scenario][mode].append(r)
    text = table(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
