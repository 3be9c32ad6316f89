"""The side-by-side comparison: direct llama-servers, llama.cpp's router and trioshed, one run.

``python -m bench.compare --quick`` (``make bench``, under 10 minutes on 2 cores) or ``--full``.
Every target gets the same binary, the same models, threads (``-t 1``) and parallel slots; the
scenarios interleave the targets and every figure is reported as a ratio to direct. Results go
to ``bench/results/<date>-<host>-<mode>.{json,md}`` plus PNG plots.

Groups of servers, each started for its scenarios and stopped after them:

| group | direct | router | trioshed | scenarios |
| --- | --- | --- | --- | --- |
| steady | one server per model | ``--models-max 4`` | max loaded 4 | overhead (+ the inbound floor: hypercorn alone, quart-trio alone), throughput, streaming, concurrent streams |
| overload | tiny-s | ``--models-max 4`` | max loaded 4, queue 8 | overload |
| swap | cold starts / 3 servers | ``--models-max 1`` | max loaded 1 | swap, contention |
| hol | tiny-s + cold starts | ``--models-max 2`` | max loaded 2 | head-of-line |
| sched | - | - | ``core.sched.plan`` in-process | scheduler scale (no processes) |
| embed | one embedding server (trioshed's runner flags) | - | max loaded 1 | indexing a corpus: chunks/s, tokens/s, CPU; the micro-batch's memory (``bench/embed_index.py``) |

A target that fails to start (trioshed while it is being written) is reported as unavailable
with the tail of its log, and the run goes on without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio

from bench import embed_index, procs, relay, report, scenarios, sched_scale, state_scale
from bench.fleet_forward import open_bare_forward
from bench.load import Target, open_client
from bench.models import GEMMA, TINY_SIZES, prepare_models
from bench.plan import API_BY_FAMILY, PLANS, TARGETS, Plan
from bench.procs import (
    Server,
    ServerFailed,
    llama_server_binary,
    open_direct,
    open_floor,
    open_router,
    open_trioshed,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: The inbound floor (``bench/floor.py``): hypercorn alone and quart-trio alone, paired with the
#: overhead scenario's "generate" requests; "raw" (no HTTP library) is the client's own cost.
FLOORS = ("raw", "hypercorn", "quart")


class Targets:
    """The servers of one group, started into an exit stack; unavailable ones noted, not fatal."""

    def __init__(self, run: scenarios.Run, stack: AsyncExitStack, wanted: Sequence[str], group: str,
                 unavailable: dict[str, str]) -> None:  # fmt: skip
        self.run = run
        self.stack = stack
        self.wanted = wanted
        self.group = group
        self.unavailable = unavailable
        self.direct: dict[str, Server] = {}
        self.servers: dict[str, Server] = {}

    async def start_direct(self, models: dict[str, Path]) -> None:
        for name, path in models.items():
            self.direct[name] = await self.stack.enter_async_context(
                open_direct(name, path, self.run.plan.flags, self.run.log_dir)
            )

    async def start(self, kind: str, cm: contextlib.AbstractAsyncContextManager[Server]) -> None:
        if kind not in self.wanted:
            return
        try:
            self.servers[kind] = await self.stack.enter_async_context(cm)
        except ServerFailed as exc:
            msg = str(exc)
            self.unavailable[f"{kind}@{self.group}"] = msg[-1500:]
            self.run.say(f"{kind} unavailable in group {self.group}: {msg.splitlines()[0]}")

    def family(self, family: str) -> dict[str, Target]:
        """The targets for one API family, direct first."""
        apis = API_BY_FAMILY[family]
        out: dict[str, Target] = {}
        if self.direct:
            first = next(iter(self.direct.values()))
            out["direct"] = Target(
                "direct", first.base_url, apis["direct"],
                model_urls=tuple((m, s.base_url) for m, s in self.direct.items()),
            )  # fmt: skip
        for kind, server in self.servers.items():
            out[kind] = Target(kind, server.base_url, apis[kind])
        return out


def mb(n: int) -> float:
    return round(n / 2**20, 1)


async def group_steady(run: scenarios.Run, models: dict[str, Path], wanted: Sequence[str],
                       unavailable: dict[str, str], meta: dict[str, Any]) -> None:  # fmt: skip
    plan = run.plan
    async with AsyncExitStack() as stack:
        g = Targets(run, stack, wanted, "steady", unavailable)
        await g.start_direct(models)
        await g.start("router", open_router(models_dir(models), len(models), plan.flags, run.log_dir))
        await g.start("trioshed", open_trioshed(models_dir(models), plan.flags, run.log_dir,
                                                max_loaded=len(models)))  # fmt: skip
        rss: dict[str, Any] = {}
        for kind, server in g.servers.items():
            rss[kind] = {"ready_ms": round(server.ready_after * 1e3, 1), "idle_rss_mb_fresh": mb(server.rss())}
        floors: dict[str, Target] = {}
        for kind in FLOORS:
            try:
                server = await stack.enter_async_context(open_floor(kind, run.log_dir))
            except ServerFailed as exc:
                unavailable[f"floor-{kind}@steady"] = str(exc)[-1500:]
                continue
            floors[f"floor-{kind}"] = Target(f"floor-{kind}", server.base_url, "ollama-raw")
        small = "tiny-s"
        forward: Target | None = None
        if small in g.direct:  # the stack's floor for a proxy: a hop that only relays, to the direct server
            try:
                fwd = await stack.enter_async_context(open_bare_forward(g.direct[small].base_url, run.log_dir, llama_server=True))
                forward = Target("floor-forward", fwd.base_url, "native")
            except ServerFailed as exc:
                unavailable["floor-forward@steady"] = str(exc)[-1500:]
        gen = g.family("generate")
        run.say(f"steady: targets {list(gen)} + {list(floors)}; warming up {list(models)}")
        meta["warmup"] = await scenarios.warm_up(run, gen, list(models))
        by_family = {f: g.family(f) for f in API_BY_FAMILY}
        by_family["generate"].update(floors)  # the inbound floor, paired with the same requests
        if forward is not None:
            by_family["generate"]["floor-forward"] = forward
            by_family["chat"]["floor-forward"] = Target("floor-forward", forward.base_url, "openai-chat")
        await scenarios.overhead(run, by_family, small)
        if not run.out_of_time():
            await scenarios.throughput(run, gen, small)
        if GEMMA in models and not run.out_of_time():
            await scenarios.streaming(run, gen, GEMMA)
        if GEMMA in models and not run.out_of_time():
            await scenarios.concurrent_streams(run, g.family("chat"), GEMMA)
        await trio.sleep(1.0)
        for kind, server in g.servers.items():
            rss[kind]["idle_rss_mb_after"] = mb(server.rss())
            rss[kind]["tree_rss_mb_after"] = mb(server.rss(tree=True))
        direct_rss = sum(s.rss() for s in g.direct.values())
        rss["direct"] = {"tree_rss_mb_after": mb(direct_rss)}
        run.results["rss"] = {"per_target": rss}


async def group_overload(run: scenarios.Run, models: dict[str, Path], wanted: Sequence[str],
                         unavailable: dict[str, str]) -> None:  # fmt: skip
    plan = run.plan
    small = {"tiny-s": models["tiny-s"]}
    async with AsyncExitStack() as stack:
        g = Targets(run, stack, wanted, "overload", unavailable)
        await g.start_direct(small)
        await g.start("router", open_router(models_dir(models), len(models), plan.flags, run.log_dir))
        await g.start("trioshed", open_trioshed(models_dir(models), plan.flags, run.log_dir,
                                                max_loaded=len(models), max_queue=plan.overload_queue))  # fmt: skip
        gen = g.family("generate")
        await scenarios.warm_up(run, gen, ["tiny-s"])
        await scenarios.overload(run, gen, "tiny-s")


async def group_swap(run: scenarios.Run, models: dict[str, Path], wanted: Sequence[str],
                     unavailable: dict[str, str]) -> None:  # fmt: skip
    plan = run.plan
    tiny = {m: p for m, p in models.items() if m in TINY_SIZES}
    async with AsyncExitStack() as stack:
        g = Targets(run, stack, wanted, "swap", unavailable)
        await g.start("router", open_router(models_dir(models), 1, plan.flags, run.log_dir))
        await g.start("trioshed", open_trioshed(models_dir(models), plan.flags, run.log_dir, max_loaded=1))
        gen = g.family("generate")
        await scenarios.warm_up(run, gen, list(tiny))
        await scenarios.swap(run, gen, tiny, plan.flags)
        if run.out_of_time():
            return
        # contention: direct is three always-loaded servers, a reference with no swaps at all
        await g.start_direct(tiny)
        gen = g.family("generate")
        await scenarios.contention(run, gen, list(tiny))


async def group_hol(run: scenarios.Run, models: dict[str, Path], wanted: Sequence[str],
                    unavailable: dict[str, str]) -> None:  # fmt: skip
    plan = run.plan
    tiny = {m: p for m, p in models.items() if m in TINY_SIZES}
    hot, others = "tiny-s", [m for m in tiny if m != "tiny-s"]
    async with AsyncExitStack() as stack:
        g = Targets(run, stack, wanted, "hol", unavailable)
        await g.start_direct({hot: tiny[hot]})
        await g.start("router", open_router(models_dir(models), 2, plan.flags, run.log_dir))
        await g.start("trioshed", open_trioshed(models_dir(models), plan.flags, run.log_dir, max_loaded=2))
        gen = g.family("generate")
        await scenarios.warm_up(run, {k: v for k, v in gen.items() if k != "direct"}, [*others, hot])
        await scenarios.warm_up(run, {"direct": gen["direct"]}, [hot])
        await scenarios.head_of_line(run, gen, hot, others, tiny, plan.flags)


def models_dir(models: dict[str, Path]) -> Path:
    return next(iter(models.values())).parent


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""


def dirty_files() -> list[str]:
    """Files modified in the working tree outside bench/ (what ran may not be the commit)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            timeout=10, cwd=Path(__file__).resolve().parent,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line[3:] and not line[3:].startswith("bench/")]


def binary_version(binary: str, env: dict[str, str]) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, env=env, timeout=30)
        return " ".join(line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version"))
    except (OSError, subprocess.SubprocessError):
        return ""


GROUPS = ("steady", "overload", "swap", "hol", "sched", "relay", "state", "embed")


async def compare(plan: Plan, *, wanted: Sequence[str], groups: Sequence[str], work: Path,
                  models: dict[str, Path], progress: bool) -> dict[str, Any]:  # fmt: skip
    """Run the groups over ``models`` (name -> GGUF path, all in one folder) and return the
    results document (not yet written)."""
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    binary, env = llama_server_binary()
    started = time.time()
    meta: dict[str, Any] = {
        "mode": plan.mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "dirty": dirty_files(),
        "binary": binary,
        "binary_version": binary_version(binary, env),
        "flags": asdict(plan.flags),
        "plan": asdict(plan),
        "targets": list(wanted),
    }
    meta["models"] = {m: str(p) for m, p in models.items()}
    unavailable: dict[str, str] = {}
    async with open_client(max_connections=max(256, plan.overload_clients * 2)) as client:
        run = scenarios.Run(client=client, plan=plan, log_dir=log_dir, progress=progress)
        run.say(f"{plan.mode}: targets {list(wanted)}, models {list(models)}, binary {meta['binary_version']}")
        with trio.move_on_after(plan.total_seconds + 240) as hard_stop:
            for group in groups:
                if run.out_of_time():
                    run.say(f"time budget spent: skipping group {group}")
                    meta.setdefault("skipped", []).append(group)
                    continue
                if group == "steady":
                    await group_steady(run, models, wanted, unavailable, meta)
                elif group == "overload":
                    await group_overload(run, models, wanted, unavailable)
                elif group == "swap":
                    await group_swap(run, models, wanted, unavailable)
                elif group == "hol":
                    await group_hol(run, models, wanted, unavailable)
                elif group == "sched":
                    run.say("scheduler scale: trioshed.core.sched.plan in-process (no processes)")
                    run.results["sched-scale"] = await trio.to_thread.run_sync(
                        lambda: sched_scale.run(**sched_scale.SIZES[plan.mode])
                    )
                elif group == "relay" and "trioshed" in wanted and plan.mode != "smoke":
                    run.say("relay ceiling: trioshed over a stand-in upstream, the raw floor, trioshed vs router (real binary)")
                    run.results["relay"] = await relay.run_all(quick=plan.mode != "full", say=run.say)
                elif group == "state" and plan.mode != "smoke":
                    run.say("scale of state: /api/ps, /metrics, /api/tags, one pass at 1,000 models / 200 fake runners")
                    run.results["state-scale"] = await state_scale.run()
                elif group == "embed" and "trioshed" in wanted and plan.mode != "smoke":
                    run.say("embeddings: indexing 1,000 chunks of ~300 tokens, trioshed vs llama-server alone")
                    run.results["embed-index"] = await embed_index.run(quick=plan.mode != "full", say=run.say, work=work)
        if hard_stop.cancelled_caught:
            run.say("hard time limit reached: the run was cut short; results so far are written")
            meta["cut_short"] = True
    leaked = list(procs.LEAKED)
    meta["elapsed_s"] = round(time.time() - started, 1)
    meta["leaked_llama_servers"] = leaked
    return {
        "tool": "bench.compare",
        "format": 1,
        "meta": meta,
        "unavailable": unavailable,
        "results": run.results,
        "summary": report.summary_rows(run.results),
        "records": run.records,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def write_outputs(doc: dict[str, Any], out_dir: Path, *, plots: bool = True) -> dict[str, Path]:
    meta = doc["meta"]
    stem = f"{meta['started'][:10]}-{meta['host']}-{meta['mode']}"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, separators=(",", ":")))
    if plots:
        paths.update(report.plots(doc, out_dir, stem))
    paths["md"].write_text(report.markdown(doc, {k: p.name for k, p in paths.items()}))
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick")
    mode.add_argument("--full", action="store_const", dest="mode", const="full")
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke",
                      help="a few requests per scenario (the harness's own test)")  # fmt: skip
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of direct,router,trioshed")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--models-from", type=Path, help="use the *.gguf files here instead of writing models")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--keep-work", action="store_true", help="keep the models and server logs")
    p.set_defaults(mode="quick")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = PLANS[args.mode]
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    bad = [t for t in wanted if t not in TARGETS] + [g for g in groups if g not in GROUPS]
    if bad or "direct" not in wanted:
        print(f"bench.compare: unknown targets/groups {bad}, or direct missing (it is the baseline)",
              file=sys.stderr)  # fmt: skip
        return 2
    work = Path(tempfile.mkdtemp(prefix="trioshed-bench-"))
    ok = False
    try:
        if args.models_from is not None:
            models = {p.stem: p for p in sorted(args.models_from.glob("*.gguf"))}
        else:
            models = prepare_models(work / "models", gemma=plan.with_gemma)
        try:
            doc = trio.run(procs.run_until_signalled, lambda: compare(
                plan, wanted=wanted, groups=groups, work=work, models=models, progress=True))  # fmt: skip
        except procs.Terminated as exc:
            print(f"bench.compare: {exc}; every server started was stopped", file=sys.stderr)
            return 128 + exc.signum
        paths = write_outputs(doc, args.out, plots=not args.no_plots)
        print(report.summary_markdown(doc))
        for kind, path in paths.items():
            print(f"wrote {kind}: {path}", file=sys.stderr)
        ok = not doc["meta"]["leaked_llama_servers"]
        return 0 if ok else 1
    finally:
        if args.keep_work or not ok:
            print(f"work folder (models, server logs) kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
