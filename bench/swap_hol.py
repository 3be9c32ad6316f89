"""Head-of-line blocking through a swap: how long a small model's first request takes
while another request waits for a large model's stream to end so that it can be swapped in.

Real ``llama-server`` children (one thread each), trioshed served in-process, a declared
inventory (``TRIOSHED_DEVICES``; the children run on the CPU, memory is accounted as if on the
declared GPU) with room for one large model plus about half of it plus 600 MiB,
``TRIOSHED_MAX_LOADED_MODELS=4``, ``TRIOSHED_NUM_PARALLEL=2``:

1. ``tiny`` (64 wide, 2 layers) is loaded with ``keep_alive: -1``;
2. ``big`` (F32, 2048 wide, 8 layers: ~1.3 GB) streams a long answer;
3. a request for ``big2`` (same size) arrives: it must wait for ``big``'s stream to end;
4. a request for ``gamma`` (256 wide, 2 layers) arrives; there is room for it now, and beside
   ``big2`` once ``big`` is gone.

Reported: the seconds ``gamma`` took, how long ``big``'s stream still ran after ``gamma`` was
asked for, and whether ``gamma`` was answered before ``big`` was unloaded. Before the fix,
``gamma`` waited for the whole rest of the stream.

Run: ``python -m bench.swap_hol [--runs 3] [--predict 48] [--models DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1024**2


def write_models(folder: Path) -> dict[str, Path]:
    from trioshed.testing.tiny import write_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    shapes = {
        "tiny": dict(n_embd=64, n_layer=2, seed=1),
        "big": dict(n_embd=2048, n_layer=8, n_head=16, seed=2),
        "big2": dict(n_embd=2048, n_layer=8, n_head=16, seed=3),
        "gamma": dict(n_embd=256, n_layer=2, seed=4),
    }
    out = {}
    for name, kw in shapes.items():
        path = folder / f"{name}.gguf"
        if not path.exists():
            write_tiny_model(path, name=name, **kw)  # type: ignore[arg-type]
        out[name] = path
    return out


def inventory(big: Path, *, num_ctx: int, num_parallel: int) -> int:
    """Room for one ``big`` plus about half of it plus 600 MiB, by trioshed's own estimate."""
    from trioshed.core.estimate import estimate
    from trioshed.core.model import RunnerOptions
    from trioshed.models.gguf_meta import read_metadata

    total = estimate(read_metadata(str(big)), RunnerOptions(num_ctx=num_ctx, num_parallel=num_parallel)).total
    return int(total * 1.5) + 600 * MiB


async def one_run(models: Path, *, predict: int, num_ctx: int) -> dict[str, Any]:
    import httpx
    import trio

    from trioshed.config_values import parse_devices
    from trioshed.testing.server import open_test_server

    size = inventory(models / "big.gguf", num_ctx=num_ctx, num_parallel=2)
    devices = parse_devices(f"cuda:0={size}")
    record: list[tuple[str, str]] = []
    result: dict[str, Any] = {"inventory_mib": round(size / MiB)}
    async with (
        open_test_server(models, record=record, devices=devices, max_loaded_models=4, num_parallel=2,
                         context_length=num_ctx) as server,  # fmt: skip
        httpx.AsyncClient(base_url=server.base_url, timeout=None) as http,
    ):
        sched = server.scheduler

        def gen(model: str, n: int, **extra: Any) -> dict[str, Any]:
            options = {"num_predict": n, "temperature": 0, "seed": 1}
            return {"model": model, "prompt": "Tell me a long story.", "options": options, **extra}

        r = await http.post("/api/generate", json=gen("tiny", 1, stream=False, keep_alive=-1))
        r.raise_for_status()
        stream_started = trio.Event()
        stream_end: list[float] = []
        stream_t: list[float] = []
        tokens = 0
        big2_done: list[float] = []

        async def stream_big() -> None:
            nonlocal tokens
            stream_t.append(time.perf_counter())
            async with http.stream("POST", "/api/generate", json=gen("big", predict)) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line:
                        stream_started.set()
                        tokens += 1
                        if json.loads(line).get("done"):
                            break
            stream_end.append(time.perf_counter())

        async def want_big2() -> None:
            (await http.post("/api/generate", json=gen("big2", 1, stream=False))).raise_for_status()
            big2_done.append(time.perf_counter())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_big)
            await stream_started.wait()
            nursery.start_soon(want_big2)
            # big2 queued and big chosen as its victim: a planning pass wakes no one, so poll
            while not (("evict", "big") in record and sched.statistics().queued >= 1):  # noqa: ASYNC110
                await trio.sleep(0.005)
            t0 = time.perf_counter()
            (await http.post("/api/generate", json=gen("gamma", 1, stream=False))).raise_for_status()
            t1 = time.perf_counter()
            big_unloaded_before_gamma = ("unloaded", "big") in record
        result.update(
            gamma_seconds=round(t1 - t0, 3),
            big_stream_left_seconds=round(stream_end[0] - t0, 3),
            big_stream_seconds=round(stream_end[0] - stream_t[0], 3),
            big_stream_chunks=tokens,
            big2_seconds=round(big2_done[0] - t0, 3),
            gamma_before_big_unloaded=not big_unloaded_before_gamma,
            room_waits=sched.statistics().room_waits if hasattr(sched.statistics(), "room_waits") else None,
            order=[f"{e} {m}" for e, m in record if e in ("load", "evict", "unloaded")],
        )
    return result


def main(argv: list[str] | None = None) -> int:
    import trio

    p = argparse.ArgumentParser(prog="python -m bench.swap_hol", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--predict", type=int, default=48, help="tokens big streams")
    p.add_argument("--num-ctx", type=int, default=512)
    p.add_argument("--models", type=Path, default=None, help="folder for the generated models (kept)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trioshed-swap-hol-") as tmp:
        folder = args.models or Path(tmp)
        write_models(folder)
        runs = []
        for i in range(args.runs):
            r = trio.run(lambda: one_run(folder, predict=args.predict, num_ctx=args.num_ctx))
            print(f"run {i + 1}: {json.dumps(r)}", file=sys.stderr)
            runs.append(r)
    gammas = sorted(r["gamma_seconds"] for r in runs)
    print(json.dumps({"runs": runs, "gamma_seconds_median": gammas[len(gammas) // 2]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
