"""Speculative decoding on Gemma 3 270M: plain against n-gram speculation (and a draft model),
per workload, interleaved in one run.

Arms are ``llama-server`` processes started with the same binary and runner flags as the rest of
the bench (``-t 1``, ``-np 4``, 4,096 tokens per slot, CPU only) plus one speculation setting each;
with ``--trioshed`` two more arms are trioshed itself, serving the same file as two models from a
``models.toml``: one with no ``speculation`` key (trioshed's default, ``"ngram"``) and one with
``speculation = "off"``. With ``--transcript`` the direct arms get what trioshed sends for a
model without a chat template like Gemma 3 270M (the conversation as a plain transcript on
``/v1/completions``), so that they answer the same prompts as the trioshed arms; without it they
chat through llama-server's fallback template.

Workloads (chat completions, streamed, prompt cache on as in real use):

| workload | what | temperature |
| --- | --- | --- |
| code-repeat | repeat 2,500 characters of Python | 0 |
| code-edit | the same code with one function renamed | 0 |
| long-chat | the next answer after ~1,500 tokens of chat history | 0 |
| free | a story, a letter or an essay (one per round, in turn) | 0.8 (seeded per round) |
| json | ten records as JSON | 0 |
| concurrent | 4 streams at once (free, json, code-edit, long-chat) on 4 slots | 0 / 0.8 |

Each round sends every workload to every arm, the arms' order rotated per round, so that drift on
a shared machine hits all of them. Reported per arm and workload: decode tokens/s (tokens after the
first, over the time from the first to the last), time to first token, tokens per CPU-second of
the ``llama-server`` process (``/proc`` user + system time, the fairer figure under contention),
drafted and accepted tokens (llama-server's ``timings``), each as a ratio to the plain arm.

Each ratio also has its range over the rounds, every round against the base arm's sample of the
same round (on a shared machine the spread says what a ratio can resolve).

Run: ``python -m bench.speculation [--rounds 3] [--tokens 200] [--arms plain,ngram-simple,...]
[--transcript] [--trioshed] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench.procs import (
    RunnerFlags,
    Server,
    free_port,
    llama_server_binary,
    open_server,
    open_trioshed,
    run_until_signalled,
)
from trioshed.api.protocols.openai_chat import transcript_completion_body
from trioshed.core.speculation import DEFAULT as SPECULATION_DEFAULT

FLAGS = RunnerFlags(threads=1, parallel=4, ctx_per_slot=4096)
#: Speculation settings compared (llama-server b10068 flags).
ARMS: dict[str, list[str]] = {
    "plain": [],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple-n4": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                        "--spec-ngram-simple-size-m", "16"],
    "ngram-simple-n8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "8",
                        "--spec-ngram-simple-size-m", "16"],
    "ngram-simple-n12": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12",
                         "--spec-ngram-simple-size-m", "16"],
    "ngram-simple-n8-m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "8",
                           "--spec-ngram-simple-size-m", "8"],
    # with --swa-full, as trioshed runs Gemma 3 when warm returns are on
    "plain-swa-full": ["--swa-full"],
    "ngram-simple-n12-swa-full": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12",
                                  "--spec-ngram-simple-size-m", "16", "--swa-full"],
    # speculation on, with a lookup so long that it never drafts: the cost of having it on
    "never-swa-full": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "200",
                       "--spec-ngram-simple-size-m", "16", "--swa-full"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
    "draft-self": ["--spec-type", "draft-simple", "--model-draft", "{model}", "--spec-draft-ngl", "0",
                   "--device-draft", "none"],
}  # fmt: skip
DEFAULT_ARMS = ("plain", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")

_REPO = Path(__file__).resolve().parent.parent
CODE = (_REPO / "trioshed" / "core" / "placement.py").read_text(encoding="utf-8")[:2500]
TURN = (
    "Tell me more about how rivers shape the land around them, from the mountains where they "
    "start to the deltas where they meet the sea, and about the towns that grew up on their banks. "
)
REPLY = (
    "Rivers carve valleys, carry sediment downstream, and build plains and deltas where they slow "
    "down; towns grew on their banks for water, trade and fertile soil, and bridges and ports "
    "followed. "
)


#: Free-form asks, one per round in turn (with a seed per round).
FREE = (
    "Write a short story about a lighthouse keeper and a storm.",
    "Write a letter to a friend about a week spent walking in the mountains.",
    "Write a short essay on why cities plant trees along their streets.",
)


def _chat_history() -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a patient geography teacher."}]
    for i in range(8):
        messages.append({"role": "user", "content": f"Question {i + 1}. {TURN * 2}"})
        messages.append({"role": "assistant", "content": REPLY * 2})
    messages.append({"role": "user", "content": "Summarise what you told me so far, in your own words."})
    return messages


def workload_bodies(name: str, tokens: int, rnd: int = 0) -> list[dict[str, Any]]:
    """The request bodies of one workload (several for the concurrent one) in round ``rnd``: the
    story's seed changes with the round (every arm gets the same one in a round), so free text
    is judged on several stories, not one."""
    user = {"role": "user"}
    bodies = {
        "code-repeat": {"messages": [{**user, "content": "Repeat this Python code exactly, nothing else:\n\n" + CODE}]},
        "code-edit": {"messages": [{**user, "content": "Rewrite this Python code with the function `fits` renamed "
                                    "to `fits_on`, and output the whole file:\n\n" + CODE}]},
        "long-chat": {"messages": _chat_history()},
        "free": {"messages": [{**user, "content": FREE[rnd % len(FREE)]}],
                 "temperature": 0.8, "seed": 7 + rnd},
        "json": {"messages": [{**user, "content": "Output a JSON array of ten users, each with id, name, email, "
                               "age and city. Only the JSON."}]},
    }  # fmt: skip
    if name == "concurrent":
        return [b for n in ("free", "json", "code-edit", "long-chat") for b in workload_bodies(n, tokens, rnd)]
    body = {"temperature": 0, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            **bodies[name]}  # fmt: skip
    return [body]


WORKLOADS = ("code-repeat", "code-edit", "long-chat", "free", "json", "concurrent")


@dataclass
class Arm:
    name: str
    server: Server
    model: str  # the ``model`` field of requests
    runner_pid: int = 0  # the llama-server process whose CPU time is counted
    transcript: bool = False  # send trioshed's transcript to /v1/completions instead of the chat
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def runner(self) -> psutil.Process:
        return psutil.Process(self.runner_pid)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


async def one_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], pid: int) -> dict[str, Any]:
    """Stream one chat completion: time to first token, decode time, tokens, drafted/accepted,
    and the runner's CPU seconds from the first token to the last (the decode alone)."""
    t0 = time.perf_counter()
    first = last = 0.0
    cpu_first = 0.0
    chunks = 0
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    text: list[str] = []
    # llama-server closes a connection after a stream: a reused one races that close
    async with http.stream("POST", url, json=body, headers={"Connection": "close"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    now = time.perf_counter()
                    if not first:
                        first, cpu_first = now, cpu_seconds(pid)
                    last = now
                    chunks += 1
                    text.append(piece)
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    tokens = int(usage.get("completion_tokens") or 0)
    return {
        "cpu_decode": cpu_seconds(pid) - cpu_first if first else None,
        "ttft": (first - t0) if first else None,
        "decode_s": last - first if first else None,
        "tokens": tokens,
        "chunks": chunks,
        "draft_n": timings.get("draft_n"),
        "draft_accepted": timings.get("draft_n_accepted"),
        "text": "".join(text),
    }


async def run_workload(http: httpx.AsyncClient, arm: Arm, workload: str, tokens: int, rnd: int = 0) -> dict[str, Any]:
    bodies = [{**b, "model": arm.model} for b in workload_bodies(workload, tokens, rnd)]
    url = arm.server.base_url + "/v1/chat/completions"
    if arm.transcript:  # what trioshed sends for a model without a chat template (Gemma 3 270M)
        bodies = [transcript_completion_body(b) for b in bodies]
        url = arm.server.base_url + "/v1/completions"
    pid = arm.runner().pid
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    results: list[dict[str, Any]] = [{} for _ in bodies]

    async def go(i: int) -> None:
        results[i] = await one_stream(http, url, bodies[i], pid)

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(go, i)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    tokens_total = sum(r["tokens"] for r in results)
    sample: dict[str, Any] = {"wall": wall, "cpu": cpu, "tokens": tokens_total, "streams": results}
    if len(results) == 1:
        r = results[0]
        sample["tps"] = (r["tokens"] - 1) / r["decode_s"] if r["decode_s"] else None
        sample["ttft"] = r["ttft"]
        cpu = r["cpu_decode"] or 0.0  # the decode's own CPU: the prompt is the same work in every arm
    else:  # aggregate: every token over the wall time of the whole batch
        sample["tps"] = tokens_total / wall
        sample["ttft"] = statistics.median(r["ttft"] for r in results if r["ttft"] is not None)
    sample["tokens_per_cpu_s"] = (tokens_total - len(results)) / cpu if cpu > 0 else None
    sample["draft_n"] = sum(r["draft_n"] or 0 for r in results)
    sample["draft_accepted"] = sum(r["draft_accepted"] or 0 for r in results)
    return sample


def _median(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def summarize(arms: Sequence[Arm], base: str = "plain") -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    by_name = {a.name: a for a in arms}
    for arm in arms:
        for workload, samples in arm.samples.items():
            row = {
                "tps": _median([s["tps"] for s in samples]),
                "ttft": _median([s["ttft"] for s in samples]),
                "tokens_per_cpu_s": _median([s["tokens_per_cpu_s"] for s in samples]),
                "draft_n": sum(s["draft_n"] for s in samples),
                "draft_accepted": sum(s["draft_accepted"] for s in samples),
                "n": len(samples),
            }
            out.setdefault(workload, {})[arm.name] = row
    for workload, rows in out.items():
        b = rows.get(base) or rows.get(_plain_of(base, by_name)) or {}
        for name, row in rows.items():
            base_name = _plain_of(name, by_name)
            base_row = rows.get(base_name, b)
            base_samples = by_name[base_name].samples.get(workload, []) if base_name in by_name else []
            for key in ("tps", "tokens_per_cpu_s", "ttft"):
                v, bv = row.get(key), base_row.get(key)
                row[key + "_ratio"] = (v / bv) if v and bv else None
                # per round, against the base arm's sample of the same round: the spread
                paired = [s[key] / t[key] for s, t in zip(by_name[name].samples[workload], base_samples, strict=False)
                          if s[key] and t[key]]  # fmt: skip
                row[key + "_ratio_range"] = (min(paired), max(paired)) if paired else None
        out[workload] = rows
    return out


def _plain_of(name: str, arms: dict[str, Arm]) -> str:
    """The arm each is compared with: trioshed's own plain arm for trioshed, else ``plain``."""
    return "trioshed-plain" if name.startswith("trioshed") and "trioshed-plain" in arms else "plain"


def markdown(table: dict[str, dict[str, dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [f"# Speculative decoding, {meta['date']}", "",
             f"Gemma 3 270M Q4_K_M, llama-server {meta['binary_version']}, `-t 1 -np 4`, CPU only, "
             f"{meta['rounds']} rounds of {meta['tokens']} tokens per stream, arms interleaved. "
             f"Load average before / after: {meta['load_before']} / {meta['load_after']} "
             f"({meta['cpus']} CPUs, shared).", "",
             "Ratios are to the plain arm (trioshed arms: to trioshed with speculation off). "
             "tok/s: decode tokens per second (concurrent: aggregate over the batch); "
             "tok/CPU-s: tokens per CPU-second of the llama-server process (single streams: from the first "
             "token to the last; concurrent: the whole batch, prompts included); "
             "accepted: accepted / drafted tokens; (lo-hi): the ratio's range over the rounds, each round "
             "against the base arm's sample of the same round.", "",
             "| workload | arm | tok/s | ratio | tok/CPU-s | ratio | TTFT s | accepted |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def spread(r: dict[str, Any], key: str) -> str:
        lo_hi = r.get(key + "_ratio_range")
        return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi and r.get("n", 0) > 1 else ""

    for workload, rows in table.items():
        for name, r in rows.items():
            acc = f"{r['draft_accepted']}/{r['draft_n']}" if r["draft_n"] else "-"
            lines.append(
                f"| {workload} | {name} | {f(r['tps'], '.1f')} | {f(r['tps_ratio'], '.2f')}x{spread(r, 'tps')} | "
                f"{f(r['tokens_per_cpu_s'], '.1f')} | "
                f"{f(r['tokens_per_cpu_s_ratio'], '.2f')}x{spread(r, 'tokens_per_cpu_s')} | "
                f"{f(r['ttft'], '.2f')} | {acc} |"
            )
    return "\n".join(lines) + "\n"


def _direct_argv(binary: str, model: Path, port: int, extra: list[str]) -> list[str]:
    return [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "gemma3", "--cache-ram", "0", *FLAGS.llama_args(),
            *(x.replace("{model}", str(model)) for x in extra)]  # fmt: skip


async def _trioshed_runner_pid(server: Server, http: httpx.AsyncClient, model: str) -> int:
    """Load ``model`` (a one-token request) and find its llama-server among trioshed's children."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    (await http.post(server.base_url + "/v1/chat/completions", json=body)).raise_for_status()
    for p in server.descendants():
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "--alias" in cmd and cmd[cmd.index("--alias") + 1] in (model, f"{model}:latest"):
            return p.pid
    raise RuntimeError(f"no llama-server for {model} under trioshed")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from bench.models import write_gemma

    work = Path(tempfile.mkdtemp(prefix="trioshed-spec-"))
    model = write_gemma(work / "models" / "gemma3.gguf")
    binary, env = llama_server_binary()
    log_dir = work / "logs"
    arms: list[Arm] = []
    load_before = os.getloadavg()
    async with AsyncExitStack() as stack:
        for name in args.arms:
            port = free_port()
            server = await stack.enter_async_context(open_server(
                name, _direct_argv(binary, model, port, ARMS[name]), env=env,
                base_url=f"http://127.0.0.1:{port}", ready_path="/health",
                log_path=log_dir / f"{name}.log", ready_timeout=180,
            ))  # fmt: skip
            arms.append(Arm(name, server, "gemma3", runner_pid=server.pid, transcript=args.transcript))
        http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=600, verify=False))
        if args.trioshed:
            # trioshed runs one runner per model file: the plain entry gets a link of its own.
            os.link(model, work / "models" / "gemma3-plain.gguf")
            (work / "models" / "models.toml").write_text(
                '[models.gemma3]\npath = "gemma3.gguf"\n\n'
                '[models.gemma3-plain]\npath = "gemma3-plain.gguf"\nspeculation = "off"\n', encoding="utf-8")  # fmt: skip
            server = await stack.enter_async_context(open_trioshed(
                work / "models", FLAGS, log_dir, max_loaded=2,
                extra_env={"TRIOSHED_CACHE_RAM": "0", "TRIOSHED_SPECULATION": SPECULATION_DEFAULT},
            ))  # fmt: skip
            for name, m in (("trioshed-plain", "gemma3-plain"), ("trioshed-default", "gemma3")):
                arms.append(Arm(name, server, m, runner_pid=await _trioshed_runner_pid(server, http, m)))
        for arm in arms:  # warm every prompt into the cache, and the first-request paths
            for workload in args.workloads:
                await run_workload(http, arm, workload, 4)
        for rnd in range(args.rounds):
            for workload in args.workloads:
                k = rnd % len(arms)
                for arm in arms[k:] + arms[:k]:
                    sample = await run_workload(http, arm, workload, args.tokens, rnd)
                    arm.samples.setdefault(workload, []).append(sample)
                    print(f"round {rnd + 1} {workload:12} {arm.name:16} tok/s {sample['tps'] or 0:6.1f}  "
                          f"tok/CPU-s {sample['tokens_per_cpu_s'] or 0:6.1f}  "
                          f"drafted {sample['draft_n']} accepted {sample['draft_accepted']}", flush=True)  # fmt: skip
    version = _binary_version(binary, env)
    table = summarize(arms)
    same = _identical_at_zero(arms)
    meta = {"date": time.strftime("%Y-%m-%d"), "binary_version": version, "rounds": args.rounds,
            "tokens": args.tokens, "load_before": " ".join(f"{x:.2f}" for x in load_before),
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "cpus": os.cpu_count(),
            "identical_at_temperature_0": same}  # fmt: skip
    return {"meta": meta, "table": table}


def _identical_at_zero(arms: Sequence[Arm]) -> dict[str, bool]:
    """Per arm: whether every temperature-0 single-stream text equals the plain arm's."""
    base = {a.name: a for a in arms}.get("plain")
    out: dict[str, bool] = {}
    if base is None:
        return out
    for arm in arms:
        same = True
        for workload in ("code-repeat", "code-edit", "long-chat", "json"):
            for a, b in zip(arm.samples.get(workload, []), base.samples.get(workload, []), strict=False):
                same &= a["streams"][0]["text"] == b["streams"][0]["text"]
        out[arm.name] = same
    return out


def _binary_version(binary: str, env: dict[str, str]) -> str:
    import subprocess

    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, env={**os.environ, **env},
                             timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "?"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--transcript", action="store_true",
                   help="direct arms get trioshed's transcript on /v1/completions (its path for Gemma 3 270M)")
    p.add_argument("--trioshed", action="store_true", help='add trioshed with its default speculation and with "off"')
    p.add_argument("--out", type=Path, default=None, help="write FILE.json and FILE.md")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for a in args.arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}; known: {', '.join(ARMS)}")
    result = trio.run(run_until_signalled, partial(main_async, args))  # a kill stops every child
    md = markdown(result["table"], result["meta"])
    md += "\nIdentical text at temperature 0 (vs plain): " + json.dumps(result["meta"]["identical_at_temperature_0"]) + "\n"
    print(md)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
