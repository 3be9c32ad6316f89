"""The shared store's cost: per-request process CPU of recording usage to PostgreSQL, to SQLite
and not at all, side by side in one run, and the rows per second the writer sustains.

``python -m bench.team_store`` starts its own PostgreSQL (:mod:`trioshed.testing.postgres`),
then for each target runs the usage recorder as ``serve()`` does (a write and a read of the
team's spends each second, in a worker thread) while requests finish at a steady rate
(``--rate`` per second for ``--seconds``), rounds interleaved; each request is what the HTTP edge
hands the recorder (a ledger entry and a queued row). Reported: this process's CPU per request
(median of rounds) for each target, and the writer's spends per second for batches of 10,000
(100 keys x 10 models). PostgreSQL's own CPU is another process's and is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from trioshed.testing.postgres import running_postgres
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import Spend
from trioshed.usage.pg import PgStore
from trioshed.usage.recorder import UsageRecorder
from trioshed.usage.store import Store


async def _cpu_per_request(store: Store | None, rate: int, seconds: float) -> float:
    recorder = UsageRecorder(store, node="bench")
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        n, tick = 0, 0.01
        per_tick = max(1, int(rate * tick))
        cpu = time.process_time()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(per_tick):
                recorder.record(Spend(f"k{n % 20}", "tiny", time.time(), prompt=30, completion=20, seconds=0.01))
                n += 1
            await trio.sleep(tick)
        await recorder.flush()
        used = time.process_time() - cpu
        nursery.cancel_scope.cancel()
    return used / n * 1e6


def _writer_rate(store: Store, batch: int = 10_000) -> float:
    spends = [Spend(f"k{i % 100}", f"m{i % 10}", time.time(), prompt=30, completion=20) for i in range(batch)]
    store.write(spends, time.time(), "bench")  # warm
    start = time.perf_counter()
    for _ in range(3):
        store.write(spends, time.time(), "bench")
    return 3 * batch / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=500, help="requests finished per second")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {"none": [], "sqlite": [], "postgresql": []}
    with running_postgres() as pg, tempfile.TemporaryDirectory(prefix="team-bench-") as tmp:
        for r in range(args.rounds):
            order = list(results) if r % 2 == 0 else list(reversed(results))
            for target in order:
                store: Store | None = {"none": None, "sqlite": UsageDB(Path(tmp) / f"u{r}.db"), "postgresql": PgStore(pg.url)}[target]
                results[target].append(trio.run(_cpu_per_request, store, args.rate, args.seconds))
        sqlite, postgres = UsageDB(Path(tmp) / "w.db"), PgStore(pg.url)
        sqlite.open()
        postgres.open()
        rates = {"sqlite": _writer_rate(sqlite), "postgresql": _writer_rate(postgres)}
        sqlite.close()
        postgres.close()
    medians = {t: statistics.median(v) for t, v in results.items()}
    print(f"process CPU per request at {args.rate}/s ({args.rounds} rounds of {args.seconds:g} s, median):")
    for t, m in medians.items():
        print(f"  {t:<11} {m:7.1f} us   rounds: {', '.join(f'{x:.1f}' for x in results[t])}")
    print(f"  postgresql over sqlite: {medians['postgresql'] - medians['sqlite']:+.1f} us per request")
    for t, rate in rates.items():
        print(f"writer, {t}: {rate:,.0f} spends/s (batches of 10,000; 100 keys x 10 models)")
    return {"cpu_us": medians, "writer": rates}


if __name__ == "__main__":
    main()
