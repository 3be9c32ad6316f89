"""What growing a model's automatic context costs: the first long request, and the short ones
around it.

trioshed served in-process with one real ``llama-server`` child (one thread,
``TRIOSHED_NUM_PARALLEL=2``), Gemma 3 270M, automatic context (nothing sets ``num_ctx``):

1. short requests (a few words, 8 tokens out) load the model at 4,096 and are timed warm;
2. a long request (~20 KB of text, about 5,000 tokens) needs 8,192: its first token waits for
   the runner to count the prompt, the model to reload at 8,192, and its prompt to be read;
3. while it waits, short requests keep arriving every ``--gap`` seconds: they are served by the
   4,096 runner's free slot until the swap, then wait for the reload;
4. afterwards, short requests are served by the 8,192 runner, and a long request of the same
   length (another first word: no shared prompt cache) is timed there: the same work without a
   resize. The resize's cost is the difference.

Reported: the seconds to first token (streamed ``/api/generate``) of each short request before,
during and after the grow, the long request's, this process's CPU seconds and the children's,
and the load average (the machine is shared: compare phases of one run, not runs).

Run: ``python -m bench.context_grow [--rounds 4] [--gap 1.0] [--runs 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHORT = "Say hello."
#: ~16 KB, about 4,400 tokens: more than a 4,096 runner holds, so it grows the context to 8,192.
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(300))
#: As long, with another first word: no prompt cache shared with LONG (the baseline after the grow).
LONG2 = "Entry" + LONG.removeprefix("Item")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


async def one_run(models: Path, *, rounds: int, gap: float) -> dict[str, Any]:
    import httpx
    import trio
    import trio.lowlevel

    from trioshed.testing.server import open_test_server

    async with (
        open_test_server(models, num_parallel=2) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=None) as http,
    ):

        async def ttft(prompt: str, n: int = 8) -> float:
            body = {"model": "gemma3", "prompt": prompt, "options": {"num_predict": n, "temperature": 0, "seed": 1}}
            t0 = time.perf_counter()
            first = None
            async with http.stream("POST", "/api/generate", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line and first is None:
                        first = time.perf_counter() - t0
            assert first is not None
            return round(first, 3)

        async def ctx() -> list[int]:
            return [m["context_length"] for m in (await http.get("/api/ps")).json()["models"]]

        cold = await ttft(SHORT)
        before = [await ttft(SHORT) for _ in range(rounds)]
        ctx_before = await ctx()
        during: list[tuple[float, float]] = []  # (asked at, ttft), seconds after the long request
        long_ttft: list[float] = []
        t_long = 0.0

        async def long() -> None:
            nonlocal t_long
            t_long = time.perf_counter()
            long_ttft.append(await ttft(LONG, 4))

        async def shorts() -> None:
            while not long_ttft:  # one short request every ``gap`` seconds until the long one answers
                await trio.sleep(gap)
                asked = time.perf_counter() - t_long
                during.append((round(asked, 3), await ttft(SHORT)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long)
            await trio.lowlevel.checkpoint()
            nursery.start_soon(shorts)
        after = [await ttft(SHORT) for _ in range(rounds)]
        long_on_grown = await ttft(LONG2, 4)  # the same work with no resize: the baseline
        ctx_after = await ctx()
        stats = server.scheduler.statistics()
    return {
        "short_cold_load": cold,
        "short_before": before,
        "context_before": ctx_before,
        "long_ttft": long_ttft[0],
        "long_ttft_on_grown_runner": long_on_grown,
        "resize_cost_s": round(long_ttft[0] - long_on_grown, 3),
        "short_during": sorted(during),
        "short_after": after,
        "context_after": ctx_after,
        "loads": stats.loads,
    }


def main(argv: list[str] | None = None) -> int:
    import trio

    from bench.models import write_gemma

    p = argparse.ArgumentParser(prog="python -m bench.context_grow", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="short requests per phase")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between short requests during the grow")
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="trioshed-context-grow-") as tmp:
        write_gemma(Path(tmp) / "gemma3.gguf")
        for _ in range(args.runs):
            load0, cpu0, kids0 = os.getloadavg(), time.process_time(), _children_cpu()
            r = trio.run(lambda: one_run(Path(tmp), rounds=args.rounds, gap=args.gap))
            r.update(
                trioshed_cpu_s=round(time.process_time() - cpu0, 2),
                llama_server_cpu_s=round(_children_cpu() - kids0, 2),
                loadavg_1m_before_after=[round(load0[0], 2), round(os.getloadavg()[0], 2)],
                cores=os.cpu_count(),
            )
            print(json.dumps(r), file=sys.stderr)
            runs.append(r)
    print(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
