"""Scheduler scale: the cost of one scheduling decision as models and queued requests grow.

**In-process, no processes, no HTTP**: this times trioshed's pure decision core
(``trioshed.core.sched.plan``) on synthetic snapshots, with a trivial CPU-only placer standing in
for real memory placement (``trioshed.core.placement`` is not what is measured here). It answers
"how does the scheduler's own work grow", not "how fast is a request".

Shapes (each a snapshot ``plan()`` is called on, repeatedly, the median time kept):

* ``busy``: every model loaded and every slot leased; all queued requests wait for slots of
  loaded models (the steady state under overload: nothing can be decided, but each call looks).
* ``dispatch``: as ``busy`` but one slot free on every runner: ``min(queued, models)`` requests
  are dispatched in the call.
* ``swap``: max loaded = models / 2, half the queued requests are for unloaded models: the call
  decides evictions and reservations.

Per call we report the time, and per queued request the time divided by the queue length; a
log-log plot shows growth against the queue (the target: <= 50 us per decision at 1,000 models
and 10,000 queued, growing no faster than linearly in the queue).

A second table drives the whole Trio scheduler loop (``trioshed.scheduler.Scheduler``) with
the in-process fake runner factory of ``trioshed.testing.fake`` (load time 0, **no processes**):
every model loaded first, then ``queued`` requests submitted at once, each acquiring and
releasing a lease; the figure is the wall time per request until the queue is drained (or the
point's time budget runs out).

Run: ``python -m bench.sched_scale [--quick|--full] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GiB = 1024**3
#: Loading every model one by one through the loop before a point is timed is bounded by this.
PRELOAD_SECONDS = 60.0
SHAPES = ("busy", "dispatch", "swap")
_GRID = {"models": (10, 100, 1000), "queued": (100, 1000, 10000), "shapes": SHAPES}
#: Keyword arguments of :func:`run` per plan mode.
SIZES: dict[str, dict[str, Any]] = {
    "quick": {**_GRID, "budget": 0.3, "max_calls": 20, "max_seconds": 120.0, "loop_budget": 8.0,
              "loop_models": (10, 100)},
    "full": {**_GRID, "budget": 2.0, "max_calls": 200, "max_seconds": 900.0, "loop_budget": 60.0,
             "loop_models": (10, 100, 1000)},
    "smoke": {"models": (10, 100), "queued": (100, 1000), "shapes": SHAPES, "budget": 0.05,
              "max_calls": 3, "max_seconds": 10.0, "loop_budget": 2.0, "loop_models": (10,)},
}


@dataclass(frozen=True)
class Point:
    shape: str
    models: int
    queued: int
    calls: int
    per_call_us: float
    per_request_us: float
    actions: int


def _imports() -> Any:
    from trioshed.core import model, sched

    return model, sched


def build_snapshot(shape: str, n_models: int, n_queued: int) -> tuple[list[Any], list[Any], Any, Callable[..., Any]]:
    """(requests, runners, machine, place) for one shape; deterministic."""
    model, sched = _imports()
    opts = model.RunnerOptions(num_ctx=1024, num_parallel=4, num_gpu=0)
    specs = [model.ModelSpec(name=f"m{i}:latest", path=f"/models/m{i}.gguf", size=10**6) for i in range(n_models)]
    est = model.MemoryEstimate(
        weights=10**6, kv=10**5, output=0, token_embd=0, compute_full=10**5, compute_partial=10**5, layers=(10**6,)
    )
    loaded = n_models if shape != "swap" else max(1, n_models // 2)
    leases = opts.num_parallel if shape in ("busy", "swap") else opts.num_parallel - 1
    runners = [
        sched.RunnerView(
            id=i, model=specs[i], options=opts, state=sched.RunnerState.READY, leases=leases,
            keep_alive=300.0, last_used=float(i), usage=(("cpu", 2 * 10**6),),
        )
        for i in range(loaded)
    ]  # fmt: skip
    requests = []
    for j in range(n_queued):
        if shape == "swap" and j % 2 == 1:
            m = specs[loaded + (j // 2) % max(1, n_models - loaded)] if n_models > loaded else specs[0]
        else:
            m = specs[j % loaded]
        requests.append(sched.RequestView(id=j, model=m, options=opts, estimate=est))
    cpu = model.Device(id="cpu", library="cpu", index=0, total=1024 * GiB, free=1000 * GiB)
    machine = sched.Machine(gpus=(), system=cpu, max_loaded=loaded)

    def place(estimate: Any, gpus: Any, *, system_free: int, **_: Any) -> Any:
        need = estimate.total
        if need <= system_free:
            return model.Placement(n_gpu_layers=0, ram=need)
        return model.DoesNotFit(needed=need, available=system_free, reason="cpu")

    return requests, runners, machine, place


def time_plan(shape: str, n_models: int, n_queued: int, *, budget: float, max_calls: int) -> Point:
    """Call ``plan()`` on one snapshot until ``budget`` seconds or ``max_calls``; median per call."""
    _, sched = _imports()
    requests, runners, machine, place = build_snapshot(shape, n_models, n_queued)
    times: list[float] = []
    actions = 0
    deadline = time.perf_counter() + budget
    while len(times) < max_calls and (len(times) < 3 or time.perf_counter() < deadline):
        t = time.perf_counter()
        out = sched.plan(requests, runners, machine, place=place, now=1000.0)
        times.append(time.perf_counter() - t)
        actions = len(out)
    per_call = statistics.median(times)
    return Point(shape, n_models, n_queued, len(times), round(per_call * 1e6, 2),
                 round(per_call * 1e6 / max(n_queued, 1), 4), actions)  # fmt: skip


def growth_exponent(points: Sequence[Point]) -> float | None:
    """Least-squares slope of log(per-call time) against log(queue): 1.0 is linear."""
    pts = [(math.log(p.queued), math.log(p.per_call_us)) for p in points if p.per_call_us > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 3)


async def drain_through_loop(n_models: int, n_queued: int, *, budget: float) -> dict[str, Any]:
    """The Trio scheduler with fake runners: load every model, then ``n_queued`` requests at
    once; wall time per request until all are served or ``budget`` seconds pass."""
    import trio
    import trio.lowlevel

    from trioshed.core.model import Device, ModelSpec, RunnerOptions
    from trioshed.devices import DeviceSource
    from trioshed.scheduler import Scheduler
    from trioshed.testing.fake import FakeFactory, fixed_estimator, simple_place

    specs = [ModelSpec(f"m{i}:latest", f"/models/m{i}.gguf") for i in range(n_models)]
    opts = RunnerOptions(num_ctx=1024, num_parallel=4, num_gpu=0)
    cpu = Device("cpu", "cpu", 0, 1024 * GiB, 1024 * GiB)
    scheduler = Scheduler(
        devices=DeviceSource((), "cpu", fixed_system=cpu),
        factory=FakeFactory(load_time=0.0),
        estimator=fixed_estimator({f"m{i}": 10**6 for i in range(n_models)}),
        place=simple_place,
        max_queue=n_queued + n_models,
        max_loaded_models=n_models,
        default_keep_alive=math.inf,
    )
    served = 0

    async def user(i: int) -> None:
        nonlocal served
        async with scheduler.acquire(specs[i % n_models], opts):
            await trio.lowlevel.checkpoint()
        served += 1

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        t_load = time.perf_counter()
        with trio.move_on_after(PRELOAD_SECONDS):
            for spec in specs:
                async with scheduler.acquire(spec, opts):
                    pass
        load_s = time.perf_counter() - t_load
        loaded = scheduler.statistics().loaded
        t0 = time.perf_counter()
        with trio.move_on_after(budget):
            async with trio.open_nursery() as users:
                for i in range(n_queued):
                    users.start_soon(user, i)
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel(reason="scale point done")
    return {
        "models": n_models,
        "queued": n_queued,
        "served": served,
        "finished": served == n_queued,
        "seconds": round(elapsed, 4),
        "us_per_request": round(elapsed * 1e6 / max(served, 1), 2),
        "preload_seconds": round(load_s, 3),
        "loaded": loaded,
        "passes": getattr(scheduler.statistics(), "passes", None),  # planning passes, preload included
    }


async def one_pass(n_models: int, n_queued: int, *, calls: int = 30) -> dict[str, Any]:
    """The cost of one planning pass of the Trio loop (views of every runner, ``plan()``, acting
    on nothing): ``n_models`` fake runners, every slot leased, ``n_queued`` requests waiting
    for those slots; the median of ``calls`` passes."""
    import trio

    from trioshed.core.model import Device, ModelSpec, RunnerOptions
    from trioshed.devices import DeviceSource
    from trioshed.scheduler import Scheduler
    from trioshed.testing.fake import FakeFactory, fixed_estimator, simple_place

    specs = [ModelSpec(f"m{i}:latest", f"/models/m{i}.gguf") for i in range(n_models)]
    opts = RunnerOptions(num_ctx=1024, num_parallel=1, num_gpu=0)
    cpu = Device("cpu", "cpu", 0, 1024 * GiB, 1024 * GiB)
    scheduler = Scheduler(
        devices=DeviceSource((), "cpu", fixed_system=cpu), factory=FakeFactory(load_time=0.0),
        estimator=fixed_estimator({f"m{i}": 10**6 for i in range(n_models)}), place=simple_place,
        max_queue=n_queued + n_models, max_loaded_models=n_models, default_keep_alive=math.inf,
    )  # fmt: skip
    release = trio.Event()

    async def hold(i: int) -> None:
        async with scheduler.acquire(specs[i % n_models], opts):
            await release.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for i in range(n_models):
            nursery.start_soon(hold, i)
            while scheduler.statistics().leased < i + 1:  # noqa: ASYNC110 (a dispatch wakes no one)
                await trio.sleep(0.001)
        for i in range(n_queued):
            nursery.start_soon(hold, i)
        while scheduler.statistics().queued < n_queued:  # noqa: ASYNC110
            await trio.sleep(0.001)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            scheduler._schedule()  # one pass, as the loop runs it
            times.append(time.perf_counter() - t)
        release.set()
        nursery.cancel_scope.cancel(reason="pass cost measured")
    return {"models": n_models, "queued": n_queued, "us_per_pass": round(statistics.median(times) * 1e6, 1)}


def run_loop(models: Sequence[int], queued: Sequence[int], *, budget: float, max_seconds: float) -> list[dict[str, Any]]:
    import trio

    out: list[dict[str, Any]] = []
    started = time.perf_counter()
    for m in models:
        for q in queued:
            if time.perf_counter() - started > max_seconds:
                out.append({"models": m, "queued": q, "skipped": True})
                continue
            point = trio.run(partial(drain_through_loop, m, q, budget=budget))
            out.append(point)
            print(f"    loop models={m:>5} queued={q:>6}: {point['us_per_request']:>10.1f} us/request, "
                  f"served {point['served']}/{q} in {point['seconds']} s", file=sys.stderr)  # fmt: skip
    return out


def run(*, models: Sequence[int], queued: Sequence[int], shapes: Sequence[str], budget: float,
        max_calls: int, max_seconds: float, loop_budget: float | None = None,
        loop_models: Sequence[int] = ()) -> dict[str, Any]:  # fmt: skip
    points: list[Point] = []
    started = time.perf_counter()
    skipped: list[str] = []
    for shape in shapes:
        for m in models:
            for q in queued:
                if time.perf_counter() - started > max_seconds:
                    skipped.append(f"{shape}/{m}/{q}")
                    continue
                p = time_plan(shape, m, q, budget=budget, max_calls=max_calls)
                points.append(p)
                print(f"{shape:>8} models={m:>5} queued={q:>6}: {p.per_call_us:>12.1f} us/call "
                      f"{p.per_request_us:>9.3f} us/request ({p.calls} calls)", file=sys.stderr)  # fmt: skip
    slopes = {
        f"{shape}/{m}": growth_exponent([p for p in points if p.shape == shape and p.models == m])
        for shape in shapes
        for m in models
    }
    loop = [] if loop_budget is None else run_loop(loop_models, queued, budget=loop_budget, max_seconds=max_seconds)
    return {"points": [p.__dict__ for p in points], "queue_growth_exponent": slopes, "skipped": skipped,
            "loop": loop}  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "Scheduler scale (in-process: trioshed.core.sched.plan on synthetic snapshots, no processes)",
        "",
        "| shape | models | queued | us per plan() call | us per queued request | actions |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in doc["points"]:
        lines.append(f"| {p['shape']} | {p['models']} | {p['queued']} | {p['per_call_us']:.1f} | "
                     f"{p['per_request_us']:.3f} | {p['actions']} |")  # fmt: skip
    lines += ["", "Growth exponent of per-call time in the queue length (1.0 = linear):", ""]
    for k, v in doc["queue_growth_exponent"].items():
        lines.append(f"- {k}: {v}")
    if doc.get("skipped"):
        lines += ["", f"Skipped for time: {', '.join(doc['skipped'])}"]
    if doc.get("loop"):
        lines += [
            "",
            "The Trio scheduler loop with in-process fake runners (no processes): all models loaded, "
            "then the queue submitted at once and drained",
            "",
            "| models (loaded) | queued | served | seconds | us per request | planning passes |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in doc["loop"]:
            if p.get("skipped"):
                lines.append(f"| {p['models']} | {p['queued']} | skipped (time) | | | |")
            else:
                lines.append(f"| {p['models']} ({p['loaded']}) | {p['queued']} | {p['served']} | {p['seconds']} | "
                             f"{p['us_per_request']} | {p.get('passes')} |")  # fmt: skip
    if doc.get("passes"):
        lines += [
            "",
            "One planning pass of the Trio loop (fake runners, every slot leased, the queue waiting for them)",
            "",
            "| runners | queued | us per pass |",
            "| ---: | ---: | ---: |",
        ]
        lines += [f"| {p['models']} | {p['queued']} | {p['us_per_pass']} |" for p in doc["passes"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({p["shape"] for p in doc["points"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.8 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for m in sorted({p["models"] for p in doc["points"]}):
            pts = sorted((p["queued"], p["per_call_us"]) for p in doc["points"] if p["shape"] == shape and p["models"] == m)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{m} models")
        ax.axhline(50, color="grey", ls="--", lw=1, label="50 us")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("queued requests")
        ax.set_ylabel("us per plan() call")
        ax.set_title(f"{shape} (in-process, no runners)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sched_scale", description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="more points and calls")
    p.add_argument("--quick", action="store_true", help="the default")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    doc = run(**SIZES["full" if args.full else "quick"])
    import trio

    doc["passes"] = [trio.run(partial(one_pass, m, q)) for m in (10, 100) for q in (100, 512)]
    doc["meta"] = {
        "tool": "bench.sched_scale",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "note": "in-process: pure plan() on synthetic snapshots; no runner processes",
    }
    stem = f"{doc['meta']['started'][:10]}-{doc['meta']['host']}-sched-scale"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(doc))
    if not args.no_plot:
        plot(doc, args.out / f"{stem}.png")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
