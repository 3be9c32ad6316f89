"""Many fine-tunes at the cost of one: 8 LoRA adapter-models on one base, side by side with
today's way (one runner per model, swapping) and with the base alone.

Targets, each run by the same clients in one session (real ``llama-server`` children, one
thread each, trioshed served in-process, ``TRIOSHED_MAX_LOADED_MODELS`` 3):

- ``group``: ``models.toml`` entries ``a1``…``a8``, each the base with its own adapter (random,
  rank 8 on ``attn_q``, mild enough that Gemma still writes text): one adapter group, one runner;
- ``per-model``: the same 8 models, each on its own copy of the base file (another file, so
  another runner): what serving adapter-models costs where every model is a runner of its own;
- ``alone``: every request to the base model itself, no adapter: the single model's numbers.

Loads: ``rotating`` (one client, requests cycling a1, a2, …, a8, a1, …) and ``mixed`` (4 clients
at once, each model drawn from a seeded random stream). Reported per load and target: loads
(``trioshed_loads_total``), the runners' peak RSS (all ``llama-server`` children, sampled every
0.1 s), generated tokens per second of wall time, the children's CPU seconds per 1,000 tokens,
and p50/p99 latency.

The price of alternating adapters in one runner (``--price``, direct ``llama-server``, the base
with the 8 adapters, 2 slots): pairs of requests at once, the same adapter in both (batched in one
decode step) against two different adapters (run in turns), and the base without adapters.

Run on a quiet machine: ``python -m bench.adapters [--tiny] [--requests 24] [--out FILE.md]``
(``--tiny``: the tiny test model instead of Gemma 3 270M, for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ADAPTERS = 8
TARGETS = ("group", "per-model", "alone")
PROMPT = "The three most useful things to know about the sea are"


def pct(values: list[float], q: float) -> float:
    from bench.stats import percentile

    return percentile(values, q) or 0.0


def prepare(folder: Path, tiny: bool) -> Path:
    """The base, its 8 adapters and the three stores (``group``, ``per-model``, ``alone``)."""
    from trioshed.testing.adapters import write_lora

    folder.mkdir(parents=True, exist_ok=True)
    if tiny:
        from trioshed.testing.tiny import write_tiny_model

        base = write_tiny_model(folder / "base.gguf", chat_template="")
        targets, strength = ("attn_q", "ffn_up"), 1.0
    else:
        from bench.models import write_gemma

        base = write_gemma(folder / "base.gguf")
        targets, strength = ("attn_q",), 0.05
    adapters = [write_lora(folder / f"l{i}.gguf", base, targets=targets, rank=8, strength=strength, seed=i) for i in range(1, ADAPTERS + 1)]
    for target in TARGETS:
        store = folder / target
        store.mkdir()
        lines = []
        for i, adapter in enumerate(adapters, 1):
            model = base
            if target == "per-model":  # another file: another runner
                model = store / f"base{i}.gguf"
                shutil.copyfile(base, model)
            if target == "alone":
                lines.append(f'[models.a{i}]\npath = "{base}"\n')
            else:
                lines.append(f'[models.a{i}]\npath = "{model}"\nadapters = ["{adapter}"]\n')
        (store / "models.toml").write_text("\n".join(lines))
    return base


class RssPeak:
    """The peak of the summed RSS of this process's ``llama-server`` children, sampled."""

    def __init__(self) -> None:
        self.peak = 0
        self.cpu = 0.0
        self._seen: dict[int, float] = {}

    def sample(self) -> None:
        import psutil

        total = 0
        for child in psutil.Process().children(recursive=True):
            try:
                if "llama-server" not in child.name():
                    continue
                total += child.memory_info().rss
                times = child.cpu_times()
                self._seen[child.pid] = times.user + times.system
            except psutil.Error:
                continue
        self.peak = max(self.peak, total)
        self.cpu = sum(self._seen.values())


async def run(target: str, load: str, folder: Path, requests: int, n_predict: int) -> dict[str, Any]:
    import httpx
    import trio

    from trioshed.testing.server import open_test_server

    lat: list[float] = []
    tokens = 0
    rss = RssPeak()
    async with (
        open_test_server(folder / target, context_length=512, num_parallel=2, max_queue=256) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=900) as http,
    ):

        async def ask(model: str) -> None:
            nonlocal tokens
            body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False,
                    "options": {"num_predict": n_predict, "temperature": 0, "seed": 1}}  # fmt: skip
            t0 = time.perf_counter()
            r = await http.post("/api/generate", json=body)
            r.raise_for_status()
            lat.append(time.perf_counter() - t0)
            tokens += int(r.json().get("eval_count") or 0)

        async def sampler(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                rss.sample()
                await trio.sleep(0.1)

        names = [f"a{i}" for i in range(1, ADAPTERS + 1)]
        started = time.perf_counter()
        async with trio.open_nursery() as outer:
            await outer.start(sampler)
            async with trio.open_nursery() as nursery:
                if load == "rotating":

                    async def rotate() -> None:
                        for i in range(requests):
                            await ask(names[i % len(names)])

                    nursery.start_soon(rotate)
                else:
                    rng = random.Random(7)
                    plans = [[rng.choice(names) for _ in range(requests // 4)] for _ in range(4)]

                    async def client(plan: list[str]) -> None:
                        for m in plan:
                            await ask(m)

                    for plan in plans:
                        nursery.start_soon(client, plan)
            wall = time.perf_counter() - started
            rss.sample()
            outer.cancel_scope.cancel()
        stats = server.scheduler.statistics()
    return {
        "requests": len(lat), "loads": stats.loads, "peak_rss_mb": round(rss.peak / 2**20, 1),
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "cpu_s_per_1k_tokens": round(rss.cpu / tokens * 1000, 2) if tokens else 0.0,
        "p50_s": round(pct(lat, 50), 3), "p99_s": round(pct(lat, 99), 3), "wall_s": round(wall, 2),
    }  # fmt: skip


def alternation_price(folder: Path, base: Path, rounds: int, n_predict: int) -> dict[str, float]:
    """Direct llama-server, the base with every adapter, 2 slots: tokens/s of pairs of requests
    with the same adapter, with two different adapters, and without adapters."""
    import httpx

    from bench.procs import free_port
    from trioshed.runner.binary import find_llama_server

    binary = find_llama_server()
    port = free_port()
    env = {**os.environ, **dict(binary.env)}
    adapters = ",".join(str(folder / f"l{i}.gguf") for i in range(1, ADAPTERS + 1))
    argv = [binary.path, "--model", str(base), "--lora", adapters, "--port", str(port), "--host", "127.0.0.1",
            "--ctx-size", "1024", "--parallel", "2", "--threads", "1", "--fit", "off", "-ngl", "0",
            "--device", "none", "--cache-ram", "0", "--no-webui"]  # fmt: skip
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

        def lora(active: int | None) -> list[dict[str, Any]]:
            return [{"id": i, "scale": 1.0 if i == active else 0.0} for i in range(ADAPTERS)]

        def pair(a: int | None, b: int | None) -> float:
            import concurrent.futures

            def one(which: int | None) -> int:
                body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
                        "cache_prompt": False, "lora": lora(which)}  # fmt: skip
                return int(httpx.post(f"{url}/completion", json=body, timeout=600).json()["timings"]["predicted_n"])

            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                n = sum(pool.map(one, (a, b)))
            return n / (time.perf_counter() - t0)

        out: dict[str, list[float]] = {"same adapter": [], "two adapters": [], "no adapter": []}
        pair(0, 0)  # warm up
        for _ in range(rounds):
            out["same adapter"].append(pair(0, 0))
            out["two adapters"].append(pair(0, 1))
            out["no adapter"].append(pair(None, None))
        return {k: round(sorted(v)[len(v) // 2], 2) for k, v in out.items()}
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| load | target | requests | loads | peak runner RSS MB | tokens/s | CPU s / 1k tokens | p50 s | p99 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for load, targets in results.items():
        for target, r in targets.items():
            lines.append(f"| {load} | {target} | {r['requests']} | {r['loads']} | {r['peak_rss_mb']} | {r['tokens_per_s']} | "
                         f"{r['cpu_s_per_1k_tokens']} | {r['p50_s']} | {r['p99_s']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import trio

    p = argparse.ArgumentParser(prog="python -m bench.adapters", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny test model (a smoke run), not Gemma 3 270M")
    p.add_argument("--requests", type=int, default=24, help="requests per load and target")
    p.add_argument("--n-predict", type=int, default=32)
    p.add_argument("--loads", default="rotating,mixed")
    p.add_argument("--price", type=int, default=3, help="rounds of the alternation price (0: skip)")
    p.add_argument("--out", type=Path, default=None, help="also write the tables (markdown) here")
    args = p.parse_args(argv)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="trioshed-adapters-") as tmp:
        folder = Path(tmp)
        base = prepare(folder, args.tiny)
        for load in args.loads.split(","):
            results[load] = {}
            for target in TARGETS:
                r = trio.run(run, target, load, folder, args.requests, args.n_predict)
                print(f"{load} {target}: {json.dumps(r)}", file=sys.stderr)
                results[load][target] = r
        text = table(results)
        if args.price:
            price = alternation_price(folder, base, args.price, args.n_predict)
            print(f"price: {json.dumps(price)}", file=sys.stderr)
            text += "\n\nTwo requests at once on one runner holding the 8 adapters (tokens/s, median):\n\n"
            text += "| same adapter | two adapters | no adapter | two adapters / same |\n| --- | --- | --- | --- |\n"
            ratio = price["two adapters"] / price["same adapter"] if price["same adapter"] else 0.0
            text += f"| {price['same adapter']} | {price['two adapters']} | {price['no adapter']} | {ratio:.2f} |"
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
