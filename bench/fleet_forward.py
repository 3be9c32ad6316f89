"""What forwarding costs: a request sent straight to the node serving it against the same request
arriving at another node of the fleet and forwarded (one hop), at concurrency 1.

``python -m bench.fleet_forward [--requests N]`` starts two trioshed processes over the stand-in
upstream (:mod:`bench.standin`: it answers at once, so the figures are trioshed's own cost): B
serves the model (warm), A knows B as a peer. Requests alternate, B direct then through A, so
each pair saw the same machine state; the median of the paired differences is the hop's cost.
Two kinds: a whole answer (``"stream": false``) and a stream of 16 tokens (to its last byte),
both on ``/api/generate``. Writes ``bench/results/<date>-fleet-forward.md``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import procs
from bench.standin import write_wrapper
from bench.stats import percentile

SECRET = "bench-fleet-secret"
RESULTS = Path(__file__).resolve().parent / "results"


async def _timed(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with http.stream("POST", url + "/api/generate", json=body) as response:
        async for _ in response.aiter_raw():
            pass
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    return elapsed


async def run(requests: int = 300) -> dict[str, Any]:
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="fleet-forward-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        flags = procs.RunnerFlags(parallel=1, ctx_per_slot=64)
        env = {"TRIOSHED_LLAMA_SERVER": str(write_wrapper(base)), "TRIOSHED_FLEET_SECRET": SECRET, "TRIOSHED_FLEET_INTERVAL": "0.2"}
        async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env={**env, "TRIOSHED_NODE_NAME": "B"}, name="B") as b:
            a_env = {**env, "TRIOSHED_NODE_NAME": "A", "TRIOSHED_PEERS": b.base_url}
            async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=a_env, name="A") as a:
                async with httpx.AsyncClient(timeout=60) as http:
                    whole = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
                    stream = {"model": "tiny", "prompt": "hi", "stream": True, "options": {"num_predict": 16}}
                    await _timed(http, b.base_url, whole)  # loads the model on B
                    await trio.sleep(1.0)  # A reads B's state (every 0.2 s)
                    for _ in range(20):  # warm-up, both ways
                        await _timed(http, b.base_url, whole)
                        await _timed(http, a.base_url, whole)
                    ps = (await http.get(a.base_url + "/api/ps")).json()
                    if ps["models"]:
                        raise RuntimeError("A loaded the model itself: nothing was forwarded")
                    rows = {}
                    for kind, body in (("whole", whole), ("stream (16 tokens)", stream)):
                        direct, forwarded = [], []
                        for _ in range(requests):
                            direct.append(await _timed(http, b.base_url, body))
                            forwarded.append(await _timed(http, a.base_url, body))
                        deltas = [f - d for d, f in zip(direct, forwarded, strict=True)]
                        rows[kind] = {
                            "direct_p50_ms": 1000 * statistics.median(direct),
                            "forwarded_p50_ms": 1000 * statistics.median(forwarded),
                            "added_p50_ms": 1000 * statistics.median(deltas),
                            "added_p90_ms": 1000 * (percentile(deltas, 90) or 0.0),
                        }
    return {"requests": requests, "rows": rows}


def report(result: dict[str, Any], note: str) -> str:
    lines = [
        f"# Forwarding cost at c=1 ({datetime.date.today()})", "",
        f"{result['requests']} requests of each kind, alternating direct to the serving node (B) and "
        "through another node (A, one hop); trioshed over the stand-in upstream. " + note, "",
        "| answer | direct p50 | through A p50 | added p50 (paired) | added p90 (paired) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for kind, row in result["rows"].items():
        lines.append(
            f"| {kind} | {row['direct_p50_ms']:.2f} ms | {row['forwarded_p50_ms']:.2f} ms | "
            f"{row['added_p50_ms']:.2f} ms | {row['added_p90_ms']:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--note", default="", help="a word on the machine (e.g. how loaded it was)")
    args = parser.parse_args()
    result = trio.run(run, args.requests)
    text = report(result, args.note)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{datetime.date.today()}-fleet-forward.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
