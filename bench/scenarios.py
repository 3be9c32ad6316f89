"""The side-by-side scenarios (a)-(g), each over already-started targets.

Each function takes a :class:`Run` (the client, the clock origin, the plan, where results go)
and the targets of its group, interleaves the targets (rotating the order every pair or round
so that drift on a shared machine hits all alike) and stores per-target records and summaries
under the scenario's name. The servers themselves are started by ``bench.compare``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.load import Block, Scenario, Target, one_request, run_block
from bench.plan import Plan
from bench.procs import RunnerFlags, open_direct
from bench.stats import RequestRecord, Summary, paired_deltas, percentile, summarize


@dataclass
class Run:
    """One benchmark run's shared state: the client, the clock origin, the plan, the results."""

    client: httpx.AsyncClient
    plan: Plan
    log_dir: Path
    t0: float = field(default_factory=time.perf_counter)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    progress: bool = True

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def keep(self, scenario: str, records: Sequence[RequestRecord]) -> None:
        for r in records:
            d = r.to_json()
            d["scenario"] = scenario
            self.records.append(d)

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t0 > self.plan.total_seconds

    def scenario(self, name: str, **config: Any) -> Scenario:
        """A Scenario with the plan's bounds."""
        config.setdefault("timeout", self.plan.request_timeout)
        config.setdefault("max_seconds", self.plan.scenario_seconds)
        return Scenario(name=name, **config)


def rotated(names: Sequence[str], i: int) -> list[str]:
    k = i % len(names)
    return [*names[k:], *names[:k]]


async def single(run: Run, target: Target, scenario: Scenario, model: str, tag: str = "") -> RequestRecord:
    rec = RequestRecord(
        target=target.name, model=model, api=scenario.api or target.api,
        start=time.perf_counter() - run.t0, tag=tag,
    )  # fmt: skip
    await one_request(run.client, target, scenario, model, rec)
    return rec


async def warm_up(run: Run, targets: Mapping[str, Target], models: Sequence[str]) -> dict[str, Any]:
    """One request per model per target: the router and trioshed load lazily. Returns the
    first-request latency (a cold load for those two) per target and model."""
    sc = run.scenario("warmup", models=tuple(models), n_predict=4, timeout=180.0)
    out: dict[str, Any] = {}
    for name, target in targets.items():
        for model in models:
            rec = await single(run, target, sc, model, tag="warmup")
            out.setdefault(name, {})[model] = {
                "status": rec.status, "total_ms": None if rec.total is None else round(rec.total * 1e3, 2),
                "error": rec.error,
            }  # fmt: skip
            if not rec.ok:
                run.say(f"warm-up {name}/{model}: {rec.status} {rec.error}")
    return out


def _summary(records: Sequence[RequestRecord], wall: float | None = None) -> Summary:
    if wall is None:
        wall = sum(r.total or 0.0 for r in records)
    return summarize(records, wall)


async def paired(
    run: Run, targets: Mapping[str, Target], scenario: Scenario, model: str, pairs: int
) -> dict[str, list[RequestRecord]]:
    """Request i goes to every target back to back (order rotated each pair), at c=1."""
    names = list(targets)
    out: dict[str, list[RequestRecord]] = {n: [] for n in names}
    with trio.move_on_after(scenario.max_seconds):
        for i in range(pairs):
            for n in rotated(names, i):
                out[n].append(await single(run, targets[n], scenario, model))
    return out


def _store_paired(run: Run, name: str, recs: Mapping[str, list[RequestRecord]], **extra: Any) -> None:
    per_target: dict[str, Any] = {}
    for n, rs in recs.items():
        s = _summary(rs)
        d: dict[str, Any] = {"summary": s.to_json()}
        if "direct" in recs and n != "direct":
            deltas = paired_deltas(recs["direct"], rs)
            d["paired_delta_ms"] = {
                "p50": _ms(percentile(deltas, 50)),
                "p90": _ms(percentile(deltas, 90)),
                "n": len(deltas),
            }
            ttft_d = [
                b.ttft - a.ttft
                for a, b in zip(recs["direct"], rs, strict=False)
                if a.ok and b.ok and a.ttft is not None and b.ttft is not None
            ]
            d["paired_ttft_delta_ms"] = {"p50": _ms(percentile(ttft_d, 50)), "n": len(ttft_d)}
        per_target[n] = d
        run.keep(name, rs)
    run.results[name] = {"per_target": per_target, **extra}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


# ---------------------------------------------------------------- (a) overhead


async def overhead(run: Run, targets_by_family: Mapping[str, Mapping[str, Target]], model: str) -> None:
    for family, targets in targets_by_family.items():
        name = f"overhead-{family}"
        run.say(f"{name}: {run.plan.overhead_pairs} paired requests at c=1 on {model}")
        sc = run.scenario(name, models=(model,), n_predict=run.plan.overhead_n_predict)
        recs = await paired(run, targets, sc, model, run.plan.overhead_pairs)
        _store_paired(run, name, recs, model=model, n_predict=sc.n_predict)


# ---------------------------------------------------------------- (b) throughput


async def interleaved_blocks(
    run: Run, targets: Mapping[str, Target], sc: Scenario, rounds: int
) -> dict[str, list[Block]]:
    """``rounds`` blocks of ``sc`` per target, the targets' order rotated each round."""
    names = list(targets)
    blocks: dict[str, list[Block]] = {t: [] for t in names}
    for r in range(rounds):
        for t in rotated(names, r):
            blocks[t].append(await run_block(run.client, targets[t], sc, t0=run.t0, round=r, progress=run.progress))
    return blocks


async def throughput(run: Run, targets: Mapping[str, Target], model: str) -> None:
    for conc, n in run.plan.throughput:
        name = f"throughput-c{conc}"
        run.say(f"{name}: {n} requests x {run.plan.throughput_rounds} rounds per target on {model}")
        sc = run.scenario(name, models=(model,), n=n, concurrency=conc, n_predict=8)
        blocks = await interleaved_blocks(run, targets, sc, run.plan.throughput_rounds)
        per_target = {}
        for t, bs in blocks.items():
            recs = [rec for b in bs for rec in b.records]
            run.keep(name, recs)
            per_target[t] = {
                "summary": summarize(recs, sum(b.wall for b in bs)).to_json(),
                "rounds": [b.summary.to_json() for b in bs],
            }
        run.results[name] = {"per_target": per_target, "model": model, "concurrency": conc}


# ---------------------------------------------------------------- (c) streaming


async def streaming(run: Run, targets: Mapping[str, Target], model: str) -> None:
    name = "streaming"
    pairs = run.plan.stream_pairs
    if pairs <= 0:
        return
    run.say(f"{name}: {pairs} paired streams of {run.plan.stream_n_predict} tokens on {model}")
    sc = run.scenario(
        name, models=(model,), n_predict=run.plan.stream_n_predict,
        prompt="Write a long story about a fox who learns to sail across the sea.",
    )  # fmt: skip
    # one short request with the same prompt first, so every target's prompt cache starts alike
    for target in targets.values():
        await single(run, target, replace(sc, n_predict=4), model, tag="warmup")
    recs = await paired(run, targets, sc, model, pairs)
    _store_paired(run, name, recs, model=model, n_predict=sc.n_predict)


async def concurrent_streams(run: Run, targets: Mapping[str, Target], model: str) -> None:
    """Many chat streams at once on one model with 4 slots (``-np 4`` / ``TRIOSHED_NUM_PARALLEL=4``):
    aggregate tokens/s over the block and time to first token p50/p99, rounds interleaved."""
    plan = run.plan
    conc = plan.concurrent_streams
    if conc <= 0:
        return
    name = "concurrent-streams"
    run.say(f"{name}: {conc} chat streams of {plan.concurrent_n_predict} tokens on {model}, "
            f"{plan.concurrent_rounds} rounds")  # fmt: skip
    sc = run.scenario(
        name, models=(model,), n=conc, concurrency=conc, n_predict=plan.concurrent_n_predict,
        prompt="Write a long story about a fox who learns to sail across the sea.",
    )  # fmt: skip
    for target in targets.values():  # the same prompt cached everywhere first
        await single(run, target, replace(sc, n_predict=4), model, tag="warmup")
    blocks = await interleaved_blocks(run, targets, sc, plan.concurrent_rounds)
    per_target = {}
    for t, bs in blocks.items():
        recs = [rec for b in bs for rec in b.records]
        run.keep(name, recs)
        ttfts = [r.ttft for r in recs if r.ok and r.ttft is not None]
        per_target[t] = {
            "summary": summarize(recs, sum(b.wall for b in bs)).to_json(),
            "tok_s_rounds": [b.summary.tok_s for b in bs],
            "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        }
    run.results[name] = {"per_target": per_target, "model": model, "streams": conc,
                         "n_predict": plan.concurrent_n_predict, "slots": plan.flags.parallel}  # fmt: skip


# ---------------------------------------------------------------- (d) swap


async def swap(
    run: Run, targets: Mapping[str, Target], models_paths: Mapping[str, Path], flags: RunnerFlags
) -> None:
    """Max loaded 1: the models requested in turn, each request a swap; direct's figure is a
    cold start of the same model (spawn, /health, first answer)."""
    name = "swap"
    models = list(models_paths)
    run.say(f"{name}: {run.plan.swap_cycles} cycles over {models}, max loaded 1")
    sc = run.scenario(name, models=tuple(models), n_predict=8)
    names = ["direct", *targets]
    recs: dict[str, list[RequestRecord]] = {n: [] for n in names}
    spawn: list[float] = []
    i = 0
    with trio.move_on_after(sc.max_seconds):
        for _cycle in range(run.plan.swap_cycles):
            for model in models:
                for n in rotated(names, i):
                    if n == "direct":
                        rec, ready = await cold_direct(run, sc, model, models_paths[model], flags)
                        spawn.append(ready)
                    else:
                        rec = await single(run, targets[n], sc, model, tag="swap")
                    recs[n].append(rec)
                i += 1
    per_target: dict[str, dict[str, Any]] = {n: {"summary": _summary(rs).to_json()} for n, rs in recs.items()}
    per_target["direct"]["spawn_to_ready_ms"] = _ms(percentile(spawn, 50))
    for rs in recs.values():
        run.keep(name, rs)
    run.results[name] = {"per_target": per_target, "models": models}


async def cold_direct(
    run: Run, sc: Scenario, model: str, path: Path, flags: RunnerFlags
) -> tuple[RequestRecord, float]:
    """A direct cold start: spawn llama-server, wait for /health, one request. The record's
    total is spawn to end of answer."""
    t_spawn = time.perf_counter()
    async with open_direct(model, path, flags, run.log_dir) as server:
        target = Target("direct", server.base_url, "native")
        rec = await single(run, target, sc, model, tag="cold")
        rec.total = time.perf_counter() - t_spawn
        rec.start = t_spawn - run.t0
        return rec, server.ready_after


# ---------------------------------------------------------------- (e) head-of-line


async def head_of_line(
    run: Run,
    targets: Mapping[str, Target],
    hot: str,
    others: Sequence[str],
    models_paths: Mapping[str, Path],
    flags: RunnerFlags,
) -> None:
    """Model ``hot`` at c=4 for a while, alone, then while another model is requested every
    few seconds (each such request a swap, max loaded 2). Direct's "swap" is a cold start of
    that model's own llama-server, the same CPU work with no scheduler involved."""
    name = "head-of-line"
    plan = run.plan
    run.say(f"{name}: {hot} at c=4, {plan.hol_seconds:g}s alone then with swaps every {plan.hol_swap_every:g}s")
    sc = run.scenario(name, models=(hot,), n=100_000, concurrency=4, n_predict=8,
                      duration=plan.hol_seconds)  # fmt: skip
    bsc = run.scenario(name + "-b", models=tuple(others), n_predict=8)
    names = list(targets)
    per_target: dict[str, Any] = {}
    for t in names:
        target = targets[t]
        alone = await run_block(run.client, target, sc, t0=run.t0, progress=run.progress, tag="alone")
        swaps: list[RequestRecord] = []

        async def swapper(target: Target = target, t: str = t, swaps: list[RequestRecord] = swaps) -> None:
            k = 0
            while True:
                await trio.sleep(plan.hol_swap_every)
                model = others[k % len(others)]
                k += 1
                if t == "direct":
                    rec, _ = await cold_direct(run, bsc, model, models_paths[model], flags)
                else:
                    rec = await single(run, target, bsc, model, tag="swap")
                swaps.append(rec)

        with_b: Block
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swapper)
            with_b = await run_block(
                run.client, target, replace(sc, name=name + "-with-b"), t0=run.t0,
                progress=run.progress, tag="with-b",
            )  # fmt: skip
            nursery.cancel_scope.cancel(reason="head-of-line phase over")
        run.keep(name, alone.records + with_b.records + swaps)
        a, w = alone.summary, with_b.summary
        per_target[t] = {
            "alone": a.to_json(),
            "with_swaps": w.to_json(),
            "swaps": _summary(swaps).to_json(),
            "p99_ratio": None if not (a.p99 and w.p99) else round(w.p99 / a.p99, 3),
            "p50_ratio": None if not (a.p50 and w.p50) else round(w.p50 / a.p50, 3),
        }
    run.results[name] = {"per_target": per_target, "hot": hot, "others": list(others)}


# ---------------------------------------------------------------- (f) overload


async def overload(run: Run, targets: Mapping[str, Target], model: str) -> None:
    name = "overload"
    plan = run.plan
    run.say(f"{name}: {plan.overload_clients} simultaneous clients, trioshed queue {plan.overload_queue}")
    sc = run.scenario(name, models=(model,), n=plan.overload_clients,
                      concurrency=plan.overload_clients, n_predict=plan.overload_n_predict)  # fmt: skip
    blocks = await interleaved_blocks(run, targets, sc, plan.overload_rounds)
    per_target = {}
    for t, bs in blocks.items():
        recs = [rec for b in bs for rec in b.records]
        run.keep(name, recs)
        per_target[t] = {"summary": summarize(recs, sum(b.wall for b in bs)).to_json(), **outcome_counts(recs)}
    run.results[name] = {"per_target": per_target, "model": model, "trioshed_max_queue": plan.overload_queue}


def outcome_counts(recs: Sequence[RequestRecord]) -> dict[str, int]:
    """answered (200), busy (503), other 5xx, 4xx, lost (no complete answer)."""
    c = {"answered": 0, "busy_503": 0, "other_5xx": 0, "client_4xx": 0, "lost": 0}
    for r in recs:
        if r.status is None:
            c["lost"] += 1
        elif r.ok:
            c["answered"] += 1
        elif r.status == 503:
            c["busy_503"] += 1
        elif r.status >= 500:
            c["other_5xx"] += 1
        elif r.status == 200:
            c["lost"] += 1  # 200 whose stream reported an error
        else:
            c["client_4xx"] += 1
    return c


# ---------------------------------------------------------------- (g) contention


async def contention(run: Run, targets: Mapping[str, Target], models: Sequence[str]) -> None:
    plan = run.plan
    names = list(targets)
    for clients in plan.contention_clients:
        name = f"contention-c{clients}"
        run.say(f"{name}: {plan.contention_requests} requests round-robin over {list(models)}")
        sc = run.scenario(name, models=tuple(models), n=plan.contention_requests,
                          concurrency=clients, n_predict=8)  # fmt: skip
        per_target = {}
        for i, t in enumerate(rotated(names, clients)):
            b = await run_block(run.client, targets[t], sc, t0=run.t0, round=i, progress=run.progress)
            run.keep(name, b.records)
            per_target[t] = {"summary": b.summary.to_json(), **outcome_counts(b.records)}
        run.results[name] = {"per_target": per_target, "models": list(models), "clients": clients}


ScenarioFn = Callable[..., Awaitable[None]]
