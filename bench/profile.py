"""Where the proxy's CPU goes: trioshed over real llama-server children, sampled with py-spy.

``python -m bench.profile`` starts trioshed over a tiny random llama (a real ``llama-server``
child, ``-t 1``, 16 slots) and runs four workloads, each while ``py-spy record`` samples the
trioshed process (``--nonblocking``, idle samples dropped, so the samples are its CPU):

- ``c1-generate``, ``c1-chat``: one client, small streamed requests (Ollama raw ``/api/generate``
  and OpenAI ``/v1/chat/completions``, 8 tokens): the per-request cost;
- ``c16-generate``, ``c16-chat``: 16 concurrent streams of ``--tokens`` tokens each: the
  per-token cost.

For each it prints the process CPU per request and per token (psutil) and the functions that
take the most of it, inclusive and self, as a share of the samples and as microseconds of CPU
per request (or per token): the share times the measured CPU. ``--json PATH`` keeps the rows.
Needs ``py-spy`` (the ``bench`` extra) and permission to read the process (root, or
``ptrace_scope`` 0). The machine's load average is printed with the results: on a loaded
machine the absolute figures grow, the proportions hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio

from bench import procs
from bench.relay import PROTOCOLS, TOKEN_MARKS, run_block

_REPO_ROOT = str(Path(__file__).resolve().parent.parent) + "/"
#: workload -> (protocol, concurrency, tokens per request or None for --tokens, requests)
WORKLOADS: dict[str, tuple[str, int, int | None, int]] = {
    "c1-generate": ("ollama-generate", 1, 8, 1000),
    "c1-chat": ("openai-chat", 1, 8, 1000),
    "c16-generate": ("ollama-generate", 16, None, 64),
    "c16-chat": ("openai-chat", 16, None, 64),
}


def _frame(frame: str) -> str:
    """``fn (path)`` as ``path-from-its-package:fn``."""
    name, _, path = frame.rpartition(" (")
    path = path.rstrip(")")
    for marker in ("site-packages/", "/python3.11/", _REPO_ROOT):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{name or '?'}"


def aggregate(raw: str) -> tuple[int, Counter[str], Counter[str]]:
    """py-spy's raw (collapsed) stacks -> (samples, inclusive per function, self per function)."""
    total = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    return total, inclusive, own


async def _sampled(pid: int, out: Path, rate: int, work: Any) -> Any:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [spy, "record", "--pid", str(pid), "--format", "raw", "--nolineno", "--nonblocking",
            "--rate", str(rate), "--output", str(out)]  # fmt: skip
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await trio.sleep(1.0)  # py-spy attaches
        result = await work()
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with trio.move_on_after(30):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return result


async def run(*, tokens: int = 256, rate: int = 200, workloads: Sequence[str] = tuple(WORKLOADS), top: int = 14,
              say: Any = print) -> dict[str, Any]:  # fmt: skip
    from trioshed.testing.tiny import write_tiny_model

    doc: dict[str, Any] = {"load_before": os.getloadavg(), "rows": {}}
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        flags = procs.RunnerFlags(parallel=16, ctx_per_slot=tokens + 64)
        async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1) as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            for protocol in ("ollama-generate", "openai-chat"):
                await run_block(port, server.pid, protocol, "tiny", 1, 4, 8)  # loads, imports, warms
            for name in workloads:
                protocol, c, n, requests = WORKLOADS[name]
                n = n or tokens
                out = base / f"{name}.txt"
                load = os.getloadavg()[0]
                block = await _sampled(server.pid, out, rate,
                                       lambda: run_block(port, server.pid, protocol, "tiny", c, n, requests))  # noqa: B023
                total, inclusive, own = aggregate(out.read_text() if out.exists() else "")
                per = block.requests if c == 1 else max(block.tokens_total, 1)
                unit = "request" if c == 1 else "token"
                cpu_us = block.cpu_s / per * 1e6
                row = {"protocol": protocol, "concurrency": c, "tokens": n, "requests": block.requests, "failed": block.failed,
                       "relayed": block.tokens_total, "cpu_s": round(block.cpu_s, 3), "wall_s": round(block.wall_s, 3),
                       "unit": unit, "cpu_us_per_unit": round(cpu_us, 1), "samples": total, "load1": load,
                       "inclusive": [(f, k / total, k / total * cpu_us) for f, k in inclusive.most_common(top * 3)] if total else [],
                       "self": [(f, k / total, k / total * cpu_us) for f, k in own.most_common(top)] if total else []}  # fmt: skip
                doc["rows"][name] = row
                say(f"\n== {name}: {protocol} c={c} {n} tokens, {block.requests} requests ({block.failed} failed), "
                    f"{cpu_us:.1f} us CPU per {unit}, {total} samples, load {load:.2f}")  # fmt: skip
                say("  self:")
                for f, share, us in row["self"]:
                    say(f"    {share * 100:5.1f} %  {us:8.2f} us  {f}")
                say("  inclusive:")
                for f, share, us in row["inclusive"]:
                    say(f"    {share * 100:5.1f} %  {us:8.2f} us  {f}")
    doc["load_after"] = os.getloadavg()
    doc["when"] = time.strftime("%Y-%m-%d %H:%M")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream in the c16 workloads")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="only these (repeatable)")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    assert set(PROTOCOLS) >= {"ollama-generate", "openai-chat"} and TOKEN_MARKS
    doc = trio.run(lambda: procs.run_until_signalled(
        lambda: run(tokens=args.tokens, rate=args.rate, workloads=args.workload or tuple(WORKLOADS), top=args.top)))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(f"\nload average before {doc['load_before']}, after {doc['load_after']} ({psutil.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
