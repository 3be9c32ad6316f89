"""A soak: ``trioshed serve`` under a mixed load and scheduled faults; every request accounted for.

``python -m bench.soak [--minutes 15] [--seed 1] [--clients 10]`` (``make soak``)

One real ``python -m trioshed serve`` over three tiny random models (``trioshed.testing.tiny``)
with real ``llama-server`` children: two loaded at most (the third swaps in), two slots each,
a short keep-alive, a small queue (16), two user keys with limits and an admin key, so that the queue and
the keys' limits are reached. Clients (seeded, ``--clients``) send every protocol the server
speaks, streamed and not: Ollama generate/chat, OpenAI chat/completions/responses/embeddings,
Anthropic messages, llama.cpp's /tokenize and the pass-through, plus requests that deserve a 4xx.

Faults, one every ``--fault-every`` seconds in a seeded rotation: a runner SIGKILLed; a runner
SIGSTOPped for 1-8 s then continued; a runner hung (SIGSTOP) under a stream it had begun; a
model's file replaced by another model; SIGHUP (reload); clients that vanish mid-stream; a
burst of twice the queue's bound at once.

Every request ends in one of the accepted outcomes: a whole answer (200, a stream ended as its
protocol ends one), a 4xx it deserved, 503 or 429 with ``Retry-After``, an error line on a
stream that had begun; a client that left on purpose is counted apart. Anything else (a 5xx
without Retry-After, a stream cut without its error line, no answer at all) is *unaccounted*,
and listed. Every ``llama-server`` trioshed ever started must be gone when it has stopped, and
none may lose its parent meanwhile (an orphan). trioshed's RSS, open file descriptors and Trio
task count are sampled every ``--sample-every`` seconds; their growth is reported (first sample
after the warm-up against the last, and the slope of a least-squares line).

Results: ``bench/results/<date>-soak.{md,json}`` and ``<date>-soak.png`` (RSS and fds over time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench import heapprobe
from bench.procs import RunnerFlags, open_trioshed
from trioshed.testing.tiny import write_tiny_model

MODELS = ("tiny-a", "tiny-b", "tiny-c")
MAX_QUEUE = 16
KEYS = {  # name -> (secret, toml fields): two users with limits, an admin without
    "alice": ("alice-secret-0001", "weight = 2\nmax_concurrent = 6\nmax_queued = 8"),
    "bob": ("bob-secret-00000002", "max_concurrent = 4\nmax_queued = 4"),
    "carol": ("carol-secret-000003", 'role = "admin"'),
}
ADMIN = "carol"  # the pass-through and /metrics are an admin's
FLAGS = RunnerFlags(threads=1, parallel=2, ctx_per_slot=2048)
ACCEPTED = ("ok", "4xx deserved", "503 retry-after", "429 retry-after", "stream error line", "client left")


@dataclass
class Outcome:
    kind: str
    outcome: str  # one of ACCEPTED, or "unaccounted"
    status: int
    seconds: float
    detail: str = ""


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    tasks: int
    runners: int
    threads: int = -1
    heap: dict[str, float] | None = None  # --heap-probe: the memory map by region, glibc's account


@dataclass
class Soak:
    url: str
    pid: int
    rng: random.Random
    models_dir: Path
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    faults: list[tuple[float, str, str]] = field(default_factory=list)
    runner_pids: set[int] = field(default_factory=set)
    #: each runner's start time: a pid reused by another process after the runner exited is not it
    runner_started: dict[int, float] = field(default_factory=dict)
    orphans: set[int] = field(default_factory=set)
    start: float = field(default_factory=time.monotonic)
    probe: Path | None = None  # --heap-probe: where the server writes malloc_info on SIGUSR2

    def now(self) -> float:
        return time.monotonic() - self.start

    def record(self, kind: str, outcome: str, status: int, began: float, detail: str = "") -> None:
        self.outcomes.append(Outcome(kind, outcome, status, round(time.monotonic() - began, 3), detail[:300]))


# -- requests ---------------------------------------------------------------------------------


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _request(rng: random.Random, key: str) -> tuple[str, str, str, dict[str, Any] | None, bool, int | None]:
    """(kind, method, path, body, streamed, the 4xx it deserves or None), drawn from the mix
    (``key``'s: the pass-through is an admin's, a user gets 403)."""
    model = rng.choice(MODELS)
    n = rng.choice((4, 16, 64, 200))
    prompt = rng.choice(("hi", "tell me a story about a river", "the quick brown fox " * rng.choice((1, 4, 12))))
    stream = rng.random() < 0.6
    kinds: list[tuple[str, str, str, dict[str, Any] | None, bool, int | None]] = [
        ("ollama generate", "POST", "/api/generate", {"model": model, "prompt": prompt, "stream": stream, "options": {"num_predict": n}}, stream, None),
        ("ollama chat", "POST", "/api/chat", {"model": model, "messages": _chat(prompt), "stream": stream, "options": {"num_predict": n}}, stream, None),
        ("openai chat", "POST", "/v1/chat/completions", {"model": model, "messages": _chat(prompt), "max_tokens": n, "stream": stream}, stream, None),
        ("openai completions", "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n, "stream": stream}, stream, None),
        ("openai responses", "POST", "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max(n, 16), "stream": stream}, stream, None),
        ("anthropic messages", "POST", "/v1/messages", {"model": model, "messages": _chat(prompt), "max_tokens": n, "stream": stream}, stream, None),
        ("openai embeddings", "POST", "/v1/embeddings", {"model": "tiny-c", "input": prompt}, False, None),
        ("llama.cpp tokenize", "POST", "/tokenize", {"model": model, "content": prompt}, False, None),
        ("pass-through props", "GET", f"/upstream/{model}/props", None, False, None if key == ADMIN else 403),
        ("bad: unknown model", "POST", "/api/generate", {"model": "no-such-model", "prompt": "x", "stream": False}, False, 404),
        ("bad: wrong type", "POST", "/v1/chat/completions", {"model": model, "messages": "not a list"}, False, 400),
    ]
    weights = [14, 12, 14, 8, 8, 10, 4, 4, 3, 1, 1]
    return rng.choices(kinds, weights)[0]


def _stream_ending(kind: str, text: str) -> str:
    """"ok" when the stream ended as its protocol ends one, "stream error line" when its last
    event is an error, else "unaccounted"."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "unaccounted"
    last = lines[-1]
    if kind.startswith("ollama"):
        try:
            data = json.loads(last)
        except ValueError:
            return "unaccounted"
        if data.get("done") is True:
            return "ok"
        return "stream error line" if "error" in data else "unaccounted"
    if kind == "anthropic messages":
        events = [ln for ln in lines if ln.startswith("event: ")]
        if events and events[-1] == "event: message_stop":
            return "ok"
        return "stream error line" if events and events[-1] == "event: error" else "unaccounted"
    if kind == "openai responses":
        events = [ln for ln in lines if ln.startswith("event: ")]
        if events and events[-1] in ("event: response.completed", "event: response.incomplete"):
            return "ok"
        return "stream error line" if events and events[-1] in ("event: response.failed", "event: error") else "unaccounted"
    if last == "data: [DONE]":
        return "ok"
    with contextlib.suppress(ValueError):
        if last.startswith("data: ") and "error" in json.loads(last[6:]):
            return "stream error line"
    return "unaccounted"


def _judge(kind: str, response: httpx.Response, text: str, streamed: bool, deserved: int | None) -> tuple[str, str]:
    status = response.status_code
    if deserved is not None and status == deserved:
        return "4xx deserved", ""
    if status == 200 and deserved is None:
        if not streamed:
            return "ok", ""
        ending = _stream_ending(kind, text)
        return ending, "" if ending == "ok" else text[-300:]
    if status in (503, 429):
        ok = response.headers.get("retry-after") is not None
        return (f"{status} retry-after", "") if ok else ("unaccounted", f"{status} without Retry-After: {text[:200]}")
    return "unaccounted", f"{status}: {text[:300]}"


async def one_request(soak: Soak, http: httpx.AsyncClient, key: str, rng: random.Random, *, vanish: bool = False) -> None:
    kind, method, path, body, streamed, deserved = _request(rng, key)
    if vanish:
        kind, method, path, streamed, deserved = "client leaves mid-stream", "POST", "/api/chat", True, None
        body = {"model": rng.choice(MODELS), "messages": _chat("a long story"), "options": {"num_predict": 400}}
    headers = {"Authorization": f"Bearer {KEYS[key][0]}"}
    began = time.monotonic()
    try:
        async with http.stream(method, path, json=body, headers=headers) as response:
            if vanish and response.status_code == 200:
                async for _ in response.aiter_lines():
                    break  # one line, then the client goes away (the connection is closed)
                soak.record(kind, "client left", 200, began)
                return
            text = (await response.aread()).decode("utf-8", "replace")
        outcome, detail = _judge(kind, response, text, streamed, deserved)
        soak.record(kind, outcome, response.status_code, began, detail)
    except httpx.HTTPError as exc:
        soak.record(kind, "unaccounted", 0, began, f"no answer: {type(exc).__name__}: {exc}")


async def client(soak: Soak, index: int, until: float, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    key = list(KEYS)[index % len(KEYS)]
    async with httpx.AsyncClient(base_url=soak.url, timeout=180, trust_env=False) as http:
        while soak.now() < until:
            await one_request(soak, http, key, rng)
            await trio.sleep(rng.uniform(0, 0.3))


# -- faults -----------------------------------------------------------------------------------


def _runners(soak: Soak) -> list[psutil.Process]:
    try:
        children = psutil.Process(soak.pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for p in children:
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("llama-server") or "llama-server" in " ".join(p.cmdline()[:3]):
                found.append(p)
    for p in found:
        with contextlib.suppress(psutil.Error):
            soak.runner_started.setdefault(p.pid, p.create_time())
    soak.runner_pids.update(p.pid for p in found)
    return found


def _still_running(soak: Soak, pid: int) -> bool:
    """Whether the runner ``pid`` still runs (not a zombie, and not another process that was
    given its pid since: a test suite running beside the soak reuses pids)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() == soak.runner_started.get(pid, proc.create_time())
    except psutil.Error:
        return False


def _runner_of(soak: Soak, model: str) -> psutil.Process | None:
    for p in _runners(soak):
        with contextlib.suppress(psutil.Error):
            if any(arg.endswith(f"{model}.gguf") for arg in p.cmdline()):
                return p
    return None


async def fault_kill(soak: Soak, rng: random.Random) -> str:
    runners = _runners(soak)
    if not runners:
        return "no runner to kill"
    victim = rng.choice(runners)
    with contextlib.suppress(psutil.Error):
        victim.send_signal(signal.SIGKILL)
    return f"SIGKILL {victim.pid}"


async def fault_stop_continue(soak: Soak, rng: random.Random) -> str:
    runners = _runners(soak)
    if not runners:
        return "no runner to stop"
    victim, seconds = rng.choice(runners), rng.uniform(1, 8)
    with contextlib.suppress(psutil.Error):
        victim.send_signal(signal.SIGSTOP)
    await trio.sleep(seconds)
    with contextlib.suppress(psutil.Error):
        victim.send_signal(signal.SIGCONT)
    return f"SIGSTOP {victim.pid} for {seconds:.1f}s, then SIGCONT"


async def fault_hang_mid_stream(soak: Soak, rng: random.Random) -> str:
    model = rng.choice(MODELS)
    body = {"model": model, "prompt": "hello", "raw": True, "options": {"num_predict": 1500, "temperature": 1}}
    headers = {"Authorization": f"Bearer {KEYS['carol'][0]}"}
    began = time.monotonic()
    hung = None
    async with httpx.AsyncClient(base_url=soak.url, timeout=180, trust_env=False) as http:
        try:
            async with http.stream("POST", "/api/generate", json=body, headers=headers) as response:
                lines = response.aiter_lines()
                text = ""
                if response.status_code == 200:
                    text = await lines.__anext__() + "\n"
                    hung = _runner_of(soak, model)
                    if hung is not None:
                        with contextlib.suppress(psutil.Error):
                            hung.send_signal(signal.SIGSTOP)
                async for line in lines:
                    text += line + "\n"
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
            outcome, detail = _judge("ollama generate", response, text, True, None)
            soak.record("stream whose runner hangs", outcome, response.status_code, began, detail)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            soak.record("stream whose runner hangs", "unaccounted", 0, began, f"no answer: {exc!r}")
        finally:
            if hung is not None:
                with contextlib.suppress(psutil.Error):
                    hung.send_signal(signal.SIGCONT)  # trioshed killed it; a survivor must not stay stopped
    return f"SIGSTOP {hung.pid if hung else None} ({model}) under a stream, {time.monotonic() - began:.1f}s to its end"


async def fault_replace_model(soak: Soak, rng: random.Random) -> str:
    model = rng.choice(MODELS)
    target = soak.models_dir / f"{model}.gguf"
    temp = soak.models_dir / f".{model}.replacing"
    seed = rng.randrange(1000)
    await trio.to_thread.run_sync(lambda: write_tiny_model(temp, context_length=4096, seed=seed, name=model))
    os.replace(temp, target)
    return f"{model}.gguf replaced (seed {seed})"


async def fault_sighup(soak: Soak, rng: random.Random) -> str:
    os.kill(soak.pid, signal.SIGHUP)
    return "SIGHUP"


async def fault_vanish(soak: Soak, rng: random.Random) -> str:
    async with httpx.AsyncClient(base_url=soak.url, timeout=180, trust_env=False) as http, trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(lambda: one_request(soak, http, "carol", random.Random(rng.random()), vanish=True))
    return "4 clients left mid-stream"


async def fault_burst(soak: Soak, rng: random.Random) -> str:
    count = 2 * MAX_QUEUE + 8
    async with httpx.AsyncClient(base_url=soak.url, timeout=180, trust_env=False, limits=httpx.Limits(max_connections=count)) as http:
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one_request, soak, http, list(KEYS)[i % len(KEYS)], random.Random(rng.random()))
    return f"burst of {count} requests at once"


FAULTS: dict[str, Callable[[Soak, random.Random], Awaitable[str]]] = {
    "kill": fault_kill,
    "stop, continue": fault_stop_continue,
    "hang mid-stream": fault_hang_mid_stream,
    "model file replaced": fault_replace_model,
    "SIGHUP": fault_sighup,
    "clients vanish": fault_vanish,
    "burst": fault_burst,
}


async def faults(soak: Soak, until: float, every: float, seed: int) -> None:
    rng = random.Random(seed)
    order = list(FAULTS)
    rng.shuffle(order)
    i = 0
    await trio.sleep(every)
    while soak.now() < until:
        name = order[i % len(order)]
        at = soak.now()
        what = await FAULTS[name](soak, rng)
        soak.faults.append((round(at, 1), name, what))
        print(f"[{at:6.0f}s] fault: {name}: {what}", file=sys.stderr, flush=True)
        i += 1
        await trio.sleep(max(0.0, every - (soak.now() - at)))


# -- sampling ---------------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return -1.0


async def _heap(soak: Soak) -> dict[str, float] | None:
    if soak.probe is None:
        return None
    found = heapprobe.regions(soak.pid)
    soak.probe.unlink(missing_ok=True)
    os.kill(soak.pid, signal.SIGUSR2)
    with trio.move_on_after(5):
        while not (soak.probe.exists() and soak.probe.read_text().rstrip().endswith("</malloc>")):  # noqa: ASYNC110
            await trio.sleep(0.05)
        found.update({f"glibc_{k}": v for k, v in heapprobe.malloc_info(soak.probe.read_text()).items()})
        with contextlib.suppress(OSError):
            found.update({f"py_{k}": v for k, v in heapprobe.pymalloc(Path(f"{soak.probe}.pymalloc").read_text()).items()})  # noqa: ASYNC240
    return found


async def sampler(soak: Soak, until: float, every: float) -> None:
    headers = {"Authorization": f"Bearer {KEYS[ADMIN][0]}"}
    async with httpx.AsyncClient(base_url=soak.url, timeout=30, trust_env=False) as http:
        while soak.now() < until:
            heap, threads = None, -1
            try:
                proc = psutil.Process(soak.pid)
                heap = await _heap(soak)  # before the RSS: a probe's trim shows in this sample
                rss, fds, threads = proc.memory_info().rss / 2**20, proc.num_fds(), proc.num_threads()
                metrics = (await http.get("/metrics", headers=headers)).text
                tasks = int(_metric(metrics, "trioshed_tasks"))
            except (psutil.Error, httpx.HTTPError):
                rss, fds, tasks = -1.0, -1, -1
            runners = _runners(soak)
            for p in runners:
                with contextlib.suppress(psutil.Error):
                    if p.ppid() == 1:
                        soak.orphans.add(p.pid)
            soak.samples.append(Sample(round(soak.now(), 1), round(rss, 1), fds, tasks, len(runners), threads, heap))
            await trio.sleep(every)


# -- report -----------------------------------------------------------------------------------


def _slope_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def report(soak: Soak, args: argparse.Namespace, stop_seconds: float, leftover: list[int], load: str) -> dict[str, Any]:
    by_outcome = Counter(o.outcome for o in soak.outcomes)
    by_kind: dict[str, Counter[str]] = {}
    for o in soak.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
    warm = [s for s in soak.samples if s.t >= args.warmup and s.rss_mb >= 0] or [s for s in soak.samples if s.rss_mb >= 0]
    growth = {}
    for name in ("rss_mb", "fds", "tasks"):
        pts = [(s.t, float(getattr(s, name))) for s in warm]
        if pts:
            values = [v for _, v in pts]
            growth[name] = {
                "first": values[0], "last": values[-1], "min": min(values), "max": max(values),
                "slope_per_hour": round(_slope_per_hour(pts), 2),
            }  # fmt: skip
            # the last ten minutes: what "flat after warm-up" is judged on (median of the first
            # and of the last minute of that window, so one sample's GC spike does not decide it)
            end = pts[-1][0]
            window = [(t, v) for t, v in pts if t >= end - 600]
            head = sorted(v for t, v in window if t < window[0][0] + 60)
            tail = sorted(v for t, v in window if t > end - 60)
            growth[name]["last_10_min"] = {
                "seconds": round(end - window[0][0], 1),
                "change": round(tail[len(tail) // 2] - head[len(head) // 2], 2),
            }
    return {
        "date": f"{date.today():%Y-%m-%d}",
        "minutes": args.minutes, "clients": args.clients, "seed": args.seed, "fault_every": args.fault_every,
        "machine_load": load,
        "requests": len(soak.outcomes),
        "outcomes": dict(by_outcome),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "unaccounted": [asdict(o) for o in soak.outcomes if o.outcome == "unaccounted"],
        "faults": soak.faults,
        "fault_counts": dict(Counter(f[1] for f in soak.faults)),
        "runners_started": len(soak.runner_pids),
        "orphans_during": sorted(soak.orphans),
        "left_after_stop": leftover,
        "sigterm_to_exit_s": round(stop_seconds, 2),
        "growth": growth,
        "samples": [asdict(s) for s in soak.samples],
    }  # fmt: skip


def markdown(result: dict[str, Any], plot: str | None) -> str:
    outcomes = result["outcomes"]
    rows = [
        f"# Soak, {result['date']}: {result['minutes']} minutes, {result['clients']} clients, a fault every {result['fault_every']} s",
        "",
        f"`python -m bench.soak --minutes {result['minutes']} --clients {result['clients']} --seed {result['seed']}`; "
        f"machine load during the run: {result['machine_load']}.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| requests | {result['requests']} |",
    ]
    for name in ACCEPTED:
        rows.append(f"| {name} | {outcomes.get(name, 0)} |")
    rows += [
        f"| **unaccounted** | **{outcomes.get('unaccounted', 0)}** |",
        f"| faults injected | {len(result['faults'])} ({', '.join(f'{k} {v}' for k, v in sorted(result['fault_counts'].items()))}) |",
        f"| runners started | {result['runners_started']} |",
        f"| orphans (during; left after stop) | {len(result['orphans_during'])}; {len(result['left_after_stop'])} |",
        f"| SIGTERM to exit at the end | {result['sigterm_to_exit_s']} s |",
    ]
    for name, label in (("rss_mb", "RSS (MB)"), ("fds", "open fds"), ("tasks", "Trio tasks")):
        g = result["growth"].get(name)
        if g:
            rows.append(
                f"| {label}: after warm-up → end (min-max), slope | {g['first']:g} → {g['last']:g} ({g['min']:g}-{g['max']:g}), {g['slope_per_hour']:+g}/h |"
            )
            last = g["last_10_min"]
            rows.append(f"| {label}: change over the last {last['seconds'] / 60:.0f} minutes (first minute's median to last's) | {last['change']:+g} |")
    rows += ["", "| request kind | " + " | ".join(ACCEPTED) + " | unaccounted |", "| --- |" + " --- |" * (len(ACCEPTED) + 1)]
    for kind, counts in result["by_kind"].items():
        rows.append(f"| {kind} | " + " | ".join(str(counts.get(n, 0)) for n in (*ACCEPTED, "unaccounted")) + " |")
    if result["unaccounted"]:
        rows += ["", "Unaccounted:", ""] + [f"- {o['kind']} ({o['status']}, {o['seconds']} s): {o['detail']}" for o in result["unaccounted"][:30]]
    if plot:
        rows += ["", f"![RSS and open fds over the soak]({plot})"]
    rows += ["", "Faults, in order:", ""] + [f"- {t:.0f} s: {name}: {what}" for t, name, what in result["faults"]]
    return "\n".join(rows) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = [s for s in result["samples"] if s["rss_mb"] >= 0]
    t = [s["t"] / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(t, [s["rss_mb"] for s in samples], color="tab:blue", label="RSS (MB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("trioshed RSS (MB)", color="tab:blue")
    ax.set_ylim(bottom=0)
    other = ax.twinx()
    other.plot(t, [s["fds"] for s in samples], color="tab:orange", label="open fds")
    other.plot(t, [s["tasks"] for s in samples], color="tab:green", label="Trio tasks", alpha=0.6)
    other.set_ylabel("open fds / Trio tasks")
    other.set_ylim(bottom=0)
    for at, _, _ in result["faults"]:
        ax.axvline(at / 60, color="grey", alpha=0.15, linewidth=0.8)
    fig.legend(loc="upper right", fontsize=8)
    ax.set_title("trioshed under a mixed load with faults (grey: a fault)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="trioshed-soak-") as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        for i, name in enumerate(MODELS):
            write_tiny_model(models / f"{name}.gguf", context_length=4096, seed=i, name=name)
        keys = root / "keys.toml"
        keys.write_text("".join(f'[[key]]\nname = "{n}"\nkey = "{s}"\n{limits}\n\n' for n, (s, limits) in KEYS.items()))
        env = {
            "TRIOSHED_KEYS_FILE": str(keys),
            "TRIOSHED_KV_CACHE_DIR": str(root / "kv"),
            "TRIOSHED_KV_CACHE_BUDGET": "256MiB",
        }
        for assignment in args.env:  # e.g. MALLOC_ARENA_MAX=2, to compare allocator settings
            name, _, value = assignment.partition("=")
            env[name] = value
        if args.heap_probe:
            folder = heapprobe.sitecustomize(root / "probe")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
            env["HEAP_PROBE_OUT"] = str(root / "malloc_info.xml")
            env["HEAP_PROBE_TRIM"] = "1" if args.heap_probe == "trim" else "0"
            if args.heap_probe == "trace":
                snaps = (args.out / f"{args.stem or 'soak'}-tracemalloc").resolve()
                snaps.mkdir(parents=True, exist_ok=True)
                env["HEAP_PROBE_TRACE"] = f"{snaps},60"
        async with open_trioshed(
            models, FLAGS, root / "logs", max_loaded=2, max_queue=MAX_QUEUE, keep_alive="20s",
            extra_env=env, ready_path="/ui",
        ) as server:  # fmt: skip
            soak = Soak(server.base_url, server.pid, random.Random(args.seed), models)
            if args.heap_probe:
                soak.probe = root / "malloc_info.xml"
            until = args.minutes * 60
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler, soak, until + 5, args.sample_every)
                nursery.start_soon(faults, soak, until - 10, args.fault_every, args.seed)
                for i in range(args.clients):
                    nursery.start_soon(client, soak, i, until, args.seed)
            _runners(soak)
            sent = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(60):
                await server.process.wait()
            stop_seconds = time.monotonic() - sent
            with trio.move_on_after(10):
                while any(_still_running(soak, p) for p in soak.runner_pids):  # noqa: ASYNC110
                    await trio.sleep(0.1)
            leftover = [p for p in soak.runner_pids if _still_running(soak, p)]
            log_tail = server.log_path.read_text(errors="replace")[-3000:]
    load_after = os.getloadavg()
    result = report(soak, args, stop_seconds, leftover, f"1-min load average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end (2 cores, shared)")
    result["log_tail"] = log_tail
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-every", type=float, default=20.0)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before growth is measured from")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="an extra variable for the server (repeatable)")
    parser.add_argument(
        "--heap-probe", choices=("look", "trim", "trace"), default=None,
        help="sample the server's memory map by region and glibc's malloc_info (trim: malloc_trim(0) first, each sample;"
        " trace: also tracemalloc snapshots every minute, into <out>/<stem>-tracemalloc/)",
    )  # fmt: skip
    parser.add_argument("--stem", default="", help="results' file name (default: <date>-soak[-<minutes>min])")
    args = parser.parse_args()
    result = trio.run(run, args)
    stem = args.stem or (f"{result['date']}-soak" if args.minutes >= 15 else f"{result['date']}-soak-{args.minutes:g}min")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{stem}.png"
    drawn = plot(result, png)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, png.name if drawn else None)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    sys.exit(1 if result["outcomes"].get("unaccounted") or result["orphans_during"] or result["left_after_stop"] else 0)


if __name__ == "__main__":
    main()
