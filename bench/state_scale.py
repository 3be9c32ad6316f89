"""Scale of state: the routes that list state, and one scheduling pass, with many models.

``python -m bench.state_scale`` builds a store of ``models`` GGUF files (hard links of one tiny
model, so 1,000 cost one file's space; each has its own path, so each is parsed and cached as
a model of its own), starts the real scheduler with the in-process fake runner factory of
:mod:`trioshed.testing.fake` (no processes) and the real app (in-process, Quart's test client:
no sockets), loads ``runners`` models, then times:

- ``GET /api/ps``, ``GET /metrics`` (after each loaded model served a request on two routes;
  each scrape reads every runner's ``/slots``, which the fake runners answer at once),
  ``GET /api/tags`` (the first ``/api/tags`` reads every GGUF
  header: reported apart as ``cold``), the median of ``calls`` calls;
- one scheduling pass of the loop (``Scheduler._schedule``: views of every runner and
  ``core.sched.plan``) with every slot leased and ``queued`` requests waiting.

Points at (models, runners) = (100, 20), (300, 60), (1000, 200) show how each grows: the
exponent is the slope of log(time) against log(models). Target: each under 50 ms at
1,000 models and 200 runners.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

GiB = 1024**3
POINTS = ((100, 20), (300, 60), (1000, 200))
TARGET_MS = 50.0
#: What each runner (one slot of 1,024) answers to ``GET /slots``, at once: a task of 256 tokens
#: (llama-server's fields, trimmed), so a scrape that read every runner says a quarter in use.
SLOTS = json.dumps([{"id": 0, "n_ctx": 1024, "is_processing": True, "n_prompt_tokens": 256, "next_token": [{"n_decoded": 0}]}]).encode()


async def measure_point(models: int, runners: int, *, queued: int = 512, calls: int = 15, work: Path) -> dict[str, Any]:
    from trioshed.api.app import create_app
    from trioshed.api.state import AppState
    from trioshed.config import Settings
    from trioshed.core.model import Device, RunnerOptions
    from trioshed.devices import DeviceSource
    from trioshed.models.stores import Stores
    from trioshed.scheduler import Scheduler
    from trioshed.testing.fake import FakeFactory, fixed_estimator, simple_place
    from trioshed.testing.tiny import write_tiny_model
    from trioshed.trace import RequestTrace

    store_dir = work / f"store-{models}"
    store_dir.mkdir(parents=True, exist_ok=True)
    first = write_tiny_model(store_dir / "m0000.gguf")
    for i in range(1, models):
        path = store_dir / f"m{i:04d}.gguf"
        if not path.exists():
            os.link(first, path)
    settings = Settings(host="127.0.0.1", port=0, models=store_dir, num_thread=1, max_loaded_models=runners, keep_alive=-1)
    cpu = Device("cpu", "cpu", 0, 1024 * GiB, 1024 * GiB)
    factory = FakeFactory(load_time=0.0)
    scheduler = Scheduler(
        devices=DeviceSource((), "cpu", fixed_system=cpu), factory=factory,
        estimator=fixed_estimator({f"m{i:04d}": 10**6 for i in range(models)}), place=simple_place,
        max_queue=queued + runners, max_loaded_models=runners, default_keep_alive=math.inf,
    )  # fmt: skip
    store = Stores(store_dir)
    state = AppState(settings=settings, store=store, scheduler=scheduler)
    app = create_app(state)
    client = app.test_client()
    opts = RunnerOptions(num_ctx=1024, num_parallel=1, num_gpu=0)
    specs = [store.resolve(f"m{i:04d}") for i in range(runners)]
    release = trio.Event()
    result: dict[str, Any] = {"models": models, "runners": runners, "queued": queued}

    async def hold(i: int) -> None:
        async with scheduler.acquire(specs[i % runners], opts):
            await release.wait()

    async def timed(path: str) -> list[float]:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            response = await client.get(path)
            await response.get_data()
            times.append((time.perf_counter() - t) * 1e3)
            assert response.status_code == 200, (path, response.status_code)
        return times

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for spec in specs:  # load every runner once (keep-alive forever)
            async with scheduler.acquire(spec, opts):
                pass
        assert scheduler.statistics().loaded == runners
        for runner in factory.live:  # a scrape reads every runner's slots: answered at once
            runner.head_time, runner.answer = 0.0, (SLOTS,)
        # as if each loaded model had served requests on two routes (what /metrics then lists)
        metrics = app.config["TRIOSHED_METRICS"]
        for spec in specs:
            for route in ("/api/chat", "/v1/chat/completions"):
                metrics.request_finished(RequestTrace(method="POST", path=route, client="bench", started=0.0, route=route,
                                                      status=200, model=spec.name, queue_wait=0.01), 0.5)  # fmt: skip
        t = time.perf_counter()
        response = await client.get("/api/tags")
        tags = json.loads(await response.get_data())
        result["tags_cold_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        assert len(tags["models"]) == models, len(tags["models"])
        for name, path in (("ps", "/api/ps"), ("metrics", "/metrics"), ("tags", "/api/tags")):
            result[f"{name}_ms"] = round(statistics.median(await timed(path)), 2)
        scraped = (await (await client.get("/metrics")).get_data()).decode()
        assert "\ntrioshed:kv_cache_usage_perc 0.25\n" in scraped, "a scrape read every runner's slots"
        ps = json.loads(await (await client.get("/api/ps")).get_data())
        assert len(ps["models"]) == runners, len(ps["models"])
        # every slot leased, ``queued`` more waiting: one pass looks at all of it and decides nothing
        for i in range(runners + queued):
            nursery.start_soon(hold, i)
        while scheduler.statistics().queued < queued:  # noqa: ASYNC110 (no event says "queued")
            await trio.sleep(0.001)
        passes = []
        for _ in range(calls):
            t = time.perf_counter()
            scheduler._schedule()
            passes.append((time.perf_counter() - t) * 1e3)
        result["pass_ms"] = round(statistics.median(passes), 3)
        release.set()
        nursery.cancel_scope.cancel(reason="point measured")
    return result


def growth(points: Sequence[dict[str, Any]], key: str) -> float | None:
    """The slope of log(time) against log(models) between the first and the last point."""
    a, b = points[0], points[-1]
    if a[key] <= 0 or b[key] <= 0:
        return None
    return round(math.log(b[key] / a[key]) / math.log(b["models"] / a["models"]), 2)


async def run(points: Sequence[tuple[int, int]] = POINTS, *, calls: int = 15) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="state-scale-") as tmp:
        rows = [await measure_point(m, r, calls=calls, work=Path(tmp)) for m, r in points]
    keys = ("ps_ms", "metrics_ms", "tags_ms", "tags_cold_ms", "pass_ms")
    biggest = rows[-1]
    return {
        "rows": rows,
        "growth": {k: growth(rows, k) for k in keys},
        "target_ms": TARGET_MS,
        "met": {k: biggest[k] < TARGET_MS for k in ("ps_ms", "metrics_ms", "tags_ms", "pass_ms")},
    }


def table(doc: dict[str, Any]) -> str:
    lines = ["| models | runners | /api/ps ms | /metrics ms | /api/tags ms (cold) | one pass ms (512 queued) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in doc["rows"]:
        lines.append(f"| {r['models']} | {r['runners']} | {r['ps_ms']} | {r['metrics_ms']} | {r['tags_ms']} ({r['tags_cold_ms']}) | {r['pass_ms']} |")
    g = doc["growth"]
    lines.append(f"| growth exponent | | {g['ps_ms']} | {g['metrics_ms']} | {g['tags_ms']} ({g['tags_cold_ms']}) | {g['pass_ms']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    doc = trio.run(lambda: run(calls=args.calls))
    print(table(doc))
    print("met (< 50 ms at 1,000 models / 200 runners):", doc["met"])
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if all(doc["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
