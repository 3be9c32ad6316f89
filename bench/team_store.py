"""The shared store's cost: per-request process CPU with usage recorded to PostgreSQL, to SQLite
and not at all, side by side in one run, and the rows per second the writer sustains.

``python -m bench.team_store`` starts its own PostgreSQL (:mod:`trioshed.testing.postgres`) and
measures two ways, each with the three targets side by side and rounds interleaved:

- **served**: three ``trioshed serve`` processes over the stand-in upstream (:mod:`bench.standin`:
  the proxy is the only limit), each with a key that has a token budget (every request asks the
  ledger): ``TRIOSHED_USAGE=false``, the SQLite file, and ``TRIOSHED_DATABASE`` (the PostgreSQL
  node also polls the keys every 2 s and reads the team's spends every second). Streamed one-token
  ``/api/generate`` requests at c=1 and c=16 (a request's fixed cost, where usage is recorded);
  each trioshed process's own CPU per request (median of rounds);
- **recorder**: the usage recorder alone in this process, as ``serve()`` runs it (a write and a
  read of the team's spends each second, in a worker thread), while requests finish at
  ``--rate`` per second: the accounting's own share of a request, which the served figures bury
  in noise on a busy machine.

Then the writer's spends per second for batches of 10,000 (100 keys x 10 models). PostgreSQL's
own CPU is another process's and is not counted: it is the database server's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import psutil
import trio

from bench import procs, relay
from bench.standin import BURST_ENV, write_wrapper
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


KEY = "bench-team-key-1"
TARGETS = ("none", "sqlite", "postgresql")


async def served(
    url: str, *, rounds: int, requests: int, concurrency: Sequence[int], idle: float = 10.0, say: Callable[[str], object] = print
) -> list[dict[str, Any]]:
    """Process CPU per request of three trioshed processes (usage off, SQLite, PostgreSQL at
    ``url``), one-token streams, rounds interleaved, one row per concurrency; and first each
    one's CPU per second while idle for ``idle`` seconds (the part that does not grow with
    requests: the writer's second, the team's spends read, the keys polled)."""
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="team-served-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        keys = base / "keys.toml"
        keys.write_text(f'[[key]]\nname = "bench"\nkey = "{KEY}"\ntokens_per_day = 1000000000\n')
        wrapper = write_wrapper(base)
        flags = procs.RunnerFlags(parallel=max(concurrency), ctx_per_slot=128)
        envs = {"none": {"TRIOSHED_USAGE": "false"}, "sqlite": {"TRIOSHED_USAGE_DB": str(base / "usage.db")},
                "postgresql": {"TRIOSHED_DATABASE": url, "TRIOSHED_NODE_NAME": "bench"}}  # fmt: skip
        rows = []
        async with AsyncExitStack() as stack:
            servers = {}
            for name in TARGETS:
                env = {"TRIOSHED_LLAMA_SERVER": str(wrapper), "TRIOSHED_MAX_CONNECTIONS": "1024", BURST_ENV: "1",
                       "TRIOSHED_KEYS_FILE": str(keys), **envs[name]}  # fmt: skip
                servers[name] = await stack.enter_async_context(
                    procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=env, ready_path="/ui", name=name)
                )
            relay.AUTH_HEADER = f"Authorization: Bearer {KEY}\r\n".encode()
            ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in servers.items()}
            for n in TARGETS:  # warm: runner loaded, paths imported
                await relay.run_block(ports[n], servers[n].pid, "ollama-generate", "tiny", 1, 1, 20)
            cpu = {n: psutil.Process(servers[n].pid) for n in TARGETS}
            before = {n: sum(p.cpu_times()[:2]) for n, p in cpu.items()}
            await trio.sleep(idle)  # all three idle at once: the per-second part (writes, reads, key polls)
            idle_ms = {n: (sum(p.cpu_times()[:2]) - before[n]) / idle * 1e3 for n, p in cpu.items()}
            say("idle, CPU per second: " + "  ".join(f"{t} {idle_ms[t]:.1f} ms" for t in TARGETS))
            for c in concurrency:
                per: dict[str, list[float]] = {t: [] for t in TARGETS}
                failed = 0
                for r in range(rounds):
                    for n in TARGETS[r % 3:] + TARGETS[: r % 3]:  # each target first in turn
                        block = await relay.run_block(ports[n], servers[n].pid, "ollama-generate", "tiny", c, 1, requests)
                        failed += block.failed
                        per[n].append(block.cpu_s / block.requests * 1e6)
                med = {t: statistics.median(v) for t, v in per.items()}
                row = {"concurrency": c, "cpu_us": med, "idle_ms_per_s": idle_ms, "rounds_us": per, "failed": failed,
                       "pg_over_sqlite": med["postgresql"] / med["sqlite"], "sqlite_over_none": med["sqlite"] / med["none"]}  # fmt: skip
                rows.append(row)
                say(f"served c={c:<3d} " + "  ".join(f"{t} {med[t]:7.1f} us/req" for t in TARGETS)
                    + f"  postgresql/sqlite {row['pg_over_sqlite']:.3f}  failed {failed}")  # fmt: skip
        return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=500, help="recorder: requests finished per second")
    parser.add_argument("--seconds", type=float, default=3.0, help="recorder: seconds per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="served: requests per block")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="served: clients at once")
    parser.add_argument("--no-served", action="store_true", help="the recorder alone (no trioshed processes)")
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {t: [] for t in TARGETS}
    rows: list[dict[str, Any]] = []
    with running_postgres() as pg, tempfile.TemporaryDirectory(prefix="team-bench-") as tmp:
        if not args.no_served:
            rows = trio.run(lambda: served(pg.url, rounds=args.rounds, requests=args.requests, concurrency=args.concurrency))
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
    print(f"recorder alone: process CPU per request at {args.rate}/s ({args.rounds} rounds of {args.seconds:g} s, median):")
    for t, m in medians.items():
        print(f"  {t:<11} {m:7.1f} us   rounds: {', '.join(f'{x:.1f}' for x in results[t])}")
    print(f"  postgresql over sqlite: {medians['postgresql'] - medians['sqlite']:+.1f} us per request")
    for row in rows:
        print(f"served c={row['concurrency']}: rounds (us/req): "
              + "; ".join(f"{t} {', '.join(f'{x:.0f}' for x in row['rounds_us'][t])}" for t in TARGETS))  # fmt: skip
    for t, rate in rates.items():
        print(f"writer, {t}: {rate:,.0f} spends/s (batches of 10,000; 100 keys x 10 models)")
    return {"cpu_us": medians, "served": rows, "writer": rates}


if __name__ == "__main__":
    main()
