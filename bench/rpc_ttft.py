"""Time to first token with a model split over llama.cpp RPC servers vs the same model local.

Two trioshed servers run side by side over the same model file, one thread per llama.cpp process:

* **local**: no RPC servers; the model runs on this machine's CPU (``-ngl 0``).
* **rpc**: a declared local GPU (``TRIOSHED_DEVICES``) holding about a third of the layers, and
  two ``rpc-server`` processes on 127.0.0.1 (CPU backend, one thread each) holding the rest. The
  declared GPU's share runs on the CPU of the llama-server child; the RPC servers' shares run in
  those processes, reached over TCP. The difference to *local* is therefore the cost of RPC itself
  (graph splits, tensors over loopback TCP, three processes in a pipeline), not a GPU's speed.

Requests alternate local / rpc (paired, order rotated) after a warm-up load of each; each is a
streamed ``/api/generate`` with a fixed prompt. Reported: time to first token (request sent to
the first chunk with text) and decode tokens/s (chunks after the first, over their time).

    python -m bench.rpc_ttft                      # Gemma 3 270M, 10 pairs
    python -m bench.rpc_ttft --model tiny-l -n 20 --out bench/results/rpc-ttft.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.models import GEMMA, prepare_models
from trioshed.config_values import parse_rpc_servers
from trioshed.core.model import Device, RunnerOptions
from trioshed.models.store import ModelStore
from trioshed.server import estimate_model
from trioshed.testing.rpc import rpc_servers
from trioshed.testing.server import open_test_server

CTX = 1024
PROMPT = "The history of the lighthouse begins"


async def one(http: httpx.AsyncClient, model: str, n_predict: int) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) of one streamed request."""
    body = {"model": model, "prompt": PROMPT, "stream": True, "options": {"num_predict": n_predict, "temperature": 0}}
    started = time.perf_counter()
    first = last = 0.0
    chunks = 0
    async with http.stream("POST", "/api/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line:
                continue
            data = json.loads(line)
            if "error" in data:
                raise RuntimeError(data["error"])
            if data.get("response"):
                now = time.perf_counter()
                if not first:
                    first = now
                last = now
                chunks += 1
    rate = (chunks - 1) / (last - first) if chunks > 1 and last > first else 0.0
    return first - started, rate


def sizes(model_path: Path, name: str) -> tuple[int, int, int]:
    """Declared bytes for the local GPU and the two servers: about a third of the layers each,
    the output layer on the last server."""
    est = estimate_model(ModelStore(model_path.parent).resolve(name), RunnerOptions(num_ctx=CTX, num_thread=1))
    layers = list(est.layers)
    k1, k2 = len(layers) // 3, 2 * len(layers) // 3
    slack = min(layers) // 2
    local = est.compute_full + sum(layers[:k1]) + slack
    first = est.compute_full + sum(layers[k1:k2]) + slack
    second = est.compute_full + sum(layers[k2:]) + est.output + slack
    return local, first, second


async def run(model: str, pairs: int, n_predict: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, rpc_servers(2, threads=1) as (a, b):
        store = Path(tmp) / "models"
        paths = prepare_models(store, tiny=() if model == GEMMA else (model,), gemma=model == GEMMA)
        local_gpu, on_a, on_b = sizes(paths[model], model)
        gpu = Device("cuda:0", "cuda", 0, local_gpu, local_gpu, name="declared cuda:0")
        servers = parse_rpc_servers(f"{a.address}={on_a},{b.address}={on_b}")
        common: dict[str, Any] = {"context_length": CTX, "keep_alive": -1.0}
        async with open_test_server(store, **common) as local, open_test_server(
            store, devices=(gpu,), rpc_servers=servers, **common
        ) as remote:
            clients = {
                "local": httpx.AsyncClient(base_url=local.base_url, timeout=300),
                "rpc": httpx.AsyncClient(base_url=remote.base_url, timeout=300),
            }
            try:
                for http in clients.values():
                    await one(http, model, 4)  # load and warm up
                (runner,) = remote.scheduler.statistics().runners
                placement = dict(zip(runner.placement.devices, runner.placement.layers, strict=True))
                samples: dict[str, list[tuple[float, float]]] = {"local": [], "rpc": []}
                for i in range(pairs):
                    order = ("local", "rpc") if i % 2 == 0 else ("rpc", "local")
                    for target in order:
                        samples[target].append(await one(clients[target], model, n_predict))
            finally:
                for http in clients.values():
                    await http.aclose()
    out: dict[str, Any] = {"model": model, "pairs": pairs, "n_predict": n_predict, "placement": placement}
    for target, values in samples.items():
        ttft = [t for t, _ in values]
        rate = [r for _, r in values]
        out[target] = {
            "ttft_p50_ms": statistics.median(ttft) * 1000,
            "ttft_mean_ms": statistics.fmean(ttft) * 1000,
            "ttft_min_ms": min(ttft) * 1000,
            "decode_tok_s_p50": statistics.median(rate),
        }
    out["ttft_ratio_p50"] = out["rpc"]["ttft_p50_ms"] / out["local"]["ttft_p50_ms"]
    out["ttft_paired_delta_p50_ms"] = statistics.median(
        (r[0] - l[0]) * 1000 for l, r in zip(samples["local"], samples["rpc"], strict=True)  # noqa: E741
    )
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Time to first token over RPC vs local ({result['model']})",
        "",
        f"{result['pairs']} paired streamed requests, {result['n_predict']} tokens each, one thread per process, "
        "loopback. Placement of the rpc run (layers per device; cuda:0 is declared and runs on the CPU): "
        + ", ".join(f"{d} {n}" for d, n in result["placement"].items()),
        "",
        "| target | TTFT p50 ms | TTFT mean ms | TTFT min ms | decode tok/s p50 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for target in ("local", "rpc"):
        r = result[target]
        lines.append(
            f"| {target} | {r['ttft_p50_ms']:.1f} | {r['ttft_mean_ms']:.1f} | {r['ttft_min_ms']:.1f} | {r['decode_tok_s_p50']:.1f} |"
        )
    lines += [
        "",
        f"rpc/local TTFT p50: {result['ttft_ratio_p50']:.2f}x; paired delta p50: {result['ttft_paired_delta_p50_ms']:+.1f} ms",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA, help="gemma3 (default) or tiny-s/tiny-m/tiny-l")
    parser.add_argument("-n", "--pairs", type=int, default=10)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    args = parser.parse_args()
    result = trio.run(run, args.model, args.pairs, args.n_predict)
    text = markdown(result)
    print(text)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(text + "\n```json\n" + json.dumps(result, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
