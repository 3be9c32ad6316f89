"""What a short request costs trioshed beyond a bare relay, counted call by call.

``python -m bench.path_cost`` starts one ``llama-server`` (a tiny random llama, ``-t 1``, 4
slots), trioshed over the same model (its own runner, same flags) and :mod:`bench.bare_forward`
in front of the direct server (hypercorn and trioshed's own upstream client relaying the bytes,
nothing else). Then, one client at a time, streamed answers of 8 tokens (Ollama's raw
``/api/generate`` through trioshed, llama-server's ``/completion`` through the bare forwarder,
which is what trioshed sends upstream for it):

1. **CPU per request** of each proxy process (user + system, psutil), in rounds that alternate;
2. **Python calls per request**, each attributed to the nearest frame of the repository's own
   code on its stack (a library call made from ``trioshed/api/pipeline/fast_path.py:_serve`` counts for
   ``_serve``; the event loop's own calls count for the function that runs it), by a profile
   hook that a ``sitecustomize`` installs in both proxies and that is switched on only for the
   counted block (``SIGUSR1`` on, ``SIGUSR2`` off and written out). The hook slows the process
   several times over, so CPU is measured in blocks without it.

Calls are exact and repeatable where CPU time on a shared 2-core machine is not: the difference
between the two proxies' calls, by owner, is where trioshed's own per-request CPU goes.
``--json PATH`` keeps everything; the markdown table goes to stdout. ``--leaf`` counts each call
for the function called (and its caller) instead, for both proxies: where the calls of a part go.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

import psutil
import trio

from bench import procs
from bench.fleet_forward import open_bare_forward
from bench.relay import run_block

_REPO = str(Path(__file__).resolve().parent.parent) + "/"

HOOK = """
import collections, json, os, signal, sys
_counts = collections.Counter()
_root = os.environ["PATH_COST_ROOT"]
_own = (_root + "trioshed/", _root + "bench/")
_leaf = os.environ.get("PATH_COST_LEAF") == "1"
def _name(code):
    return code.co_filename.rsplit("/site-packages/", 1)[-1].replace(_root, "").rsplit("/lib/python3", 1)[-1] + ":" + code.co_name
def _hook(frame, event, arg):
    if event != "call":
        return
    if _leaf:
        back = frame.f_back
        caller = "" if back is None else _name(back.f_code)
        _counts[_name(frame.f_code) + " <- " + caller] += 1
        return
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_own):
            _counts[name[len(_root):] + ":" + f.f_code.co_name] += 1
            return
        f = f.f_back
    _counts["(no frame of the repository)"] += 1
def _on(*_):
    _counts.clear()
    sys.setprofile(_hook)
def _off(*_):
    sys.setprofile(None)
    with open(os.environ["PATH_COST_OUT"] + ".tmp", "w") as out:
        json.dump(_counts, out)
    os.replace(os.environ["PATH_COST_OUT"] + ".tmp", os.environ["PATH_COST_OUT"])
signal.signal(signal.SIGUSR1, _on)
signal.signal(signal.SIGUSR2, _off)
"""

#: owner (a prefix of ``path:function``) -> the part of a request it is, for the summary
PARTS: tuple[tuple[str, str], ...] = (
    ("trioshed/api/pipeline/listener.py", "shared: hypercorn reading the request and writing to the socket"),
    ("trioshed/runner/process.py", "other (background tasks, the runner's log reader)"),
    ("trioshed/runner/", "shared: the upstream client (connect, send, read, de-chunk)"),
    ("trioshed/api/pipeline/wrapper.py:send_and_end", "shared: the answer's way through hypercorn and h11"),
    ("bench/bare_forward.py:app", "shared: the answer's way through hypercorn and h11"),
    ("trioshed/cli/", "the event loop (its iterations and task switches)"),
    ("bench/bare_forward.py:main", "the event loop (its iterations and task switches)"),
    ("trioshed/api/pipeline/drain.py", "the request wrapper: drain guard, bounded waits on the runner"),
    ("trioshed/api/pipeline/fast_path.py", "the request wrapper: body, the client's departure, answer"),
    ("trioshed/api/pipeline/wrapper.py", "the request wrapper: trace, gate, CORS"),
    ("trioshed/api/observe/request_log.py", "the end of the request: metrics, activity, usage"),
    ("trioshed/api/observe/metrics.py", "the end of the request: metrics, activity, usage"),
    ("trioshed/activity.py", "the end of the request: metrics, activity, usage"),
    ("trioshed/usage/", "the end of the request: metrics, activity, usage"),
    ("trioshed/api/state.py", "the end of the request: metrics, activity, usage"),
    ("trioshed/api/pipeline/upstream.py", "the upstream stream: lease, bounded reads, batching"),
    ("trioshed/api/protocols/", "the translation (Ollama's chunks)"),
    ("trioshed/api/routes/ollama.py", "the route (Ollama generate)"),
    ("trioshed/api/pipeline/preamble.py", "the route's preamble: options, need, capabilities"),
    ("trioshed/core/", "the route's preamble: options, need, capabilities"),
    ("trioshed/models/", "model resolution (the store's folders)"),
    ("trioshed/scheduler/", "the scheduler: lease, wake-ups, release"),
    ("trioshed/", "other (background tasks, the runner's log reader)"),
    ("bench/", "other (background tasks, the runner's log reader)"),
)


def part_of(owner: str) -> str:
    return next((label for prefix, label in PARTS if owner.startswith(prefix)), "outside the repository")


async def _counted(pid: int, out: Path, work: Any) -> Counter[str]:
    """The calls process ``pid`` makes while ``work()`` runs (its hook on, then off and written)."""
    os.kill(pid, signal.SIGUSR1)
    await trio.sleep(0.3)
    await work()
    os.kill(pid, signal.SIGUSR2)
    written = trio.Path(out)
    with trio.fail_after(10):
        while not await written.exists():  # noqa: ASYNC110 (another process writes it)
            await trio.sleep(0.05)
    counts = Counter(json.loads(await written.read_text()))
    await written.unlink()
    return counts


async def run(*, requests: int = 1000, rounds: int = 4, source: Path | None = None, leaf: bool = False, say: Any = print) -> dict[str, Any]:
    from trioshed.testing.tiny import write_tiny_model

    doc: dict[str, Any] = {"load_before": os.getloadavg(), "requests": requests, "rounds": rounds,
                           "source": str(source) if source else ""}  # fmt: skip
    root = f"{source}/" if source else _REPO  # absolute (main resolves it)
    with tempfile.TemporaryDirectory(prefix="path-cost-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        hook = base / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        flags = procs.RunnerFlags(parallel=4, ctx_per_slot=256)
        pythonpath = os.pathsep.join([str(hook), root.rstrip("/"), os.environ.get("PYTHONPATH", "")])
        ts_env = {"PYTHONPATH": pythonpath, "PATH_COST_ROOT": root, "PATH_COST_OUT": str(base / "trioshed.json")}
        bare_env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
                    "PATH_COST_ROOT": _REPO, "PATH_COST_OUT": str(base / "bare.json")}  # fmt: skip
        if leaf:
            ts_env["PATH_COST_LEAF"] = bare_env["PATH_COST_LEAF"] = "1"
        async with procs.open_direct("tiny", models / "tiny.gguf", flags, base / "logs") as direct, \
                procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=ts_env, source=source) as ts, \
                open_bare_forward(direct.base_url, base / "logs", llama_server=True, extra_env=bare_env) as bare:  # fmt: skip
            targets = {
                "trioshed": (int(ts.base_url.rsplit(":", 1)[1]), ts.pid, "ollama-generate"),
                "bare": (int(bare.base_url.rsplit(":", 1)[1]), bare.pid, "native"),
            }
            for port, pid, protocol in targets.values():  # loads, imports, warms
                await run_block(port, pid, protocol, "tiny", 1, 8, 100)
            cpu: dict[str, list[float]] = {t: [] for t in targets}
            wall: dict[str, list[float]] = {t: [] for t in targets}
            for r in range(rounds):
                for name in (list(targets) if r % 2 == 0 else list(reversed(targets))):
                    port, pid, protocol = targets[name]
                    block = await run_block(port, pid, protocol, "tiny", 1, 8, requests)
                    if block.failed:
                        raise RuntimeError(f"{name}: {block.failed} of {requests} requests failed")
                    cpu[name].append(block.cpu_s / requests * 1e6)
                    wall[name].append(block.wall_s / requests * 1e3)
            calls: dict[str, Counter[str]] = {}
            for name, (port, pid, protocol) in targets.items():
                out = base / f"{name}.json"
                calls[name] = await _counted(pid, out, lambda: run_block(port, pid, protocol, "tiny", 1, 8, requests))  # noqa: B023
    doc["cpu_us_per_request"] = cpu
    doc["wall_ms_per_request"] = wall
    doc["calls_per_request"] = {t: {k: v / requests for k, v in c.most_common()} for t, c in calls.items()}
    doc["load_after"] = os.getloadavg()
    doc["when"] = time.strftime("%Y-%m-%d %H:%M")
    doc["leaf"] = leaf
    say(leaf_markdown(doc) if leaf else markdown(doc))
    return doc


def leaf_markdown(doc: dict[str, Any], *, top: int = 60) -> str:
    """``--leaf``: calls per request by the function called (not by owner), both proxies."""
    ts: Counter[str] = Counter()
    bare: Counter[str] = Counter()
    for counts, into in ((doc["calls_per_request"]["trioshed"], ts), (doc["calls_per_request"]["bare"], bare)):
        for key, n in counts.items():
            into[key.split(" <- ")[0]] += n
    lines = ["| function called | trioshed | bare forwarder | difference |", "| --- | ---: | ---: | ---: |"]
    names = sorted(set(ts) | set(bare), key=lambda k: -max(ts.get(k, 0), bare.get(k, 0)))[:top]
    for name in names:
        a, b = ts.get(name, 0.0), bare.get(name, 0.0)
        lines.append(f"| `{name}` | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    return "\n".join(lines)


def markdown(doc: dict[str, Any], *, top: int = 25) -> str:
    cpu, wall, calls = doc["cpu_us_per_request"], doc["wall_ms_per_request"], doc["calls_per_request"]
    ts, bare = calls["trioshed"], calls["bare"]
    lines = [
        f"c=1, streamed answers of 8 tokens, {doc['requests']} requests a block, {doc['rounds']} rounds ({doc['when']}, "
        f"load average {doc['load_before'][0]:.2f} before, {doc['load_after'][0]:.2f} after)",
        "",
        "| | trioshed (Ollama raw generate) | bare forwarder (`/completion`) | difference |",
        "| --- | ---: | ---: | ---: |",
        f"| CPU per request, median of rounds (us) | {median(cpu['trioshed']):.0f} | {median(cpu['bare']):.0f} | "
        f"{median(cpu['trioshed']) - median(cpu['bare']):+.0f} |",
        f"| wall per request, median of rounds (ms) | {median(wall['trioshed']):.2f} | {median(wall['bare']):.2f} | "
        f"{median(wall['trioshed']) - median(wall['bare']):+.2f} |",
        f"| Python calls per request | {sum(ts.values()):.0f} | {sum(bare.values()):.0f} | {sum(ts.values()) - sum(bare.values()):+.0f} |",
        "",
        "By part (Python calls per request, each counted for the nearest frame of the repository's code):",
        "",
        "| part | trioshed | bare forwarder |",
        "| --- | ---: | ---: |",
    ]
    parts_ts: Counter[str] = Counter()
    parts_bare: Counter[str] = Counter()
    for owner, n in ts.items():
        parts_ts[part_of(owner)] += n
    for owner, n in bare.items():
        parts_bare[part_of(owner)] += n
    for part in sorted(set(parts_ts) | set(parts_bare), key=lambda p: -(parts_ts[p] + parts_bare[p])):
        lines.append(f"| {part} | {parts_ts[part]:.0f} | {parts_bare[part]:.0f} |")
    lines += ["", f"trioshed's functions with the most calls outside the shared parts (top {top}):", "",
              "| function (with the library code it calls) | calls per request |", "| --- | ---: |"]  # fmt: skip
    own = [(k, v) for k, v in ts.items() if not part_of(k).startswith("shared")]
    for owner, n in sorted(own, key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{owner}` | {n:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="requests a block")
    parser.add_argument("--rounds", type=int, default=4, help="CPU blocks per proxy, alternating")
    parser.add_argument("--source", type=Path, help="another checkout's trioshed (e.g. a worktree of an earlier commit), for a before/after")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--leaf", action="store_true", help="count calls by the function called instead of by owner")
    args = parser.parse_args(argv)
    doc = trio.run(lambda: procs.run_until_signalled(lambda: run(requests=args.requests, rounds=args.rounds, source=args.source.resolve() if args.source else None, leaf=args.leaf)))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(f"\n({psutil.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
