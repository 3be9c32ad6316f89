"""Load: 2,000 requests from 200 concurrent clients over 3 tiny models, a queue of 64 and at
most 2 runners, against a real ``python -m trioshed serve``. Every request is answered 200 or
503 with Retry-After, none past a bound, no 500; afterwards no lease, nothing queued, <= 2 runners.

Random models per request with 2 of 3 loadable thrash: FIFO order makes most loads evict the
other model (measured: 372 loads for 1,427 answers with 4 slots per runner).

The figures are printed (``pytest -s``) and written to ``$TRIOSHED_LOAD_REPORT`` when set.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.serve_process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

CLIENTS, PER_CLIENT, MODELS = 200, 10, ("tiny", "two", "three")
# seconds: no request may take longer. A hang guard, not a speed target (those live in bench/):
# the slowest request took 19-50 s while eight other suites shared this 2-core machine, and the
# earlier 30 s bound failed under that load on main's code as well.
BOUND = 90.0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_2000_requests_from_200_clients_are_all_answered_200_or_503(model_store: Path) -> None:
    add_tiny(model_store, "two", seed=2)
    add_tiny(model_store, "three", seed=3)
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    problems: list[str] = []
    rng = random.Random(11)
    with trio.fail_after(300):
        async with serve_process(
            model_store, TRIOSHED_MAX_QUEUE="64", TRIOSHED_MAX_LOADED_MODELS="2", TRIOSHED_KEEP_ALIVE="5m",
            TRIOSHED_NUM_PARALLEL="4",  # 1 works too (measured: 56 s, 929 loads); 4 keeps make test shorter
        ) as served:
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
            async with httpx.AsyncClient(base_url=served.url, timeout=BOUND + 30, limits=limits) as http:

                async def client(models: list[str]) -> None:
                    for model in models:
                        started = time.monotonic()
                        r = await http.post("/api/generate", json={
                            "model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2, "temperature": 0},
                        })  # fmt: skip
                        latencies.append(time.monotonic() - started)
                        statuses[r.status_code] += 1
                        if r.status_code == 503 and not r.headers.get("Retry-After", "").isdigit():
                            problems.append(f"503 without Retry-After: {r.text[:200]}")
                        elif r.status_code not in (200, 503):
                            problems.append(f"{r.status_code}: {r.text[:200]}")

                began = time.monotonic()
                async with trio.open_nursery() as nursery:
                    for _ in range(CLIENTS):
                        nursery.start_soon(client, [rng.choice(MODELS) for _ in range(PER_CLIENT)])
                elapsed = time.monotonic() - began
                with trio.fail_after(30):  # unloads in flight settle
                    while True:
                        text = (await http.get("/metrics")).text
                        if metric(text, "trioshed_leases") == 0 and len(served.runner_pids()) <= 2:
                            break
                        await trio.sleep(0.1)
                queued = metric(text, "trioshed_queued_requests")
                loads = metric(text, "trioshed_loads_total")
                ps = (await http.get("/api/ps")).json()["models"]
    report = {
        "requests": CLIENTS * PER_CLIENT, "clients": CLIENTS, "answered": sum(statuses.values()),
        "status_200": statuses[200], "status_503": statuses[503], "other": sum(v for k, v in statuses.items() if k not in (200, 503)),
        "max_latency_s": round(max(latencies), 3), "p50_latency_s": round(sorted(latencies)[len(latencies) // 2], 3),
        "elapsed_s": round(elapsed, 2), "loads": int(loads),
    }  # fmt: skip
    print("\nload:", json.dumps(report))
    if os.environ.get("TRIOSHED_LOAD_REPORT"):
        await trio.Path(os.environ["TRIOSHED_LOAD_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")
    assert not problems, problems[:5]
    assert report["answered"] == CLIENTS * PER_CLIENT and report["status_200"] > 0
    assert max(latencies) < BOUND
    assert queued == 0 and len(ps) <= 2
