"""Usage recording's cost on the hot path: trioshed with ``TRIOSHED_USAGE`` on and off, side by side.

``python -m bench.usage_overhead`` starts two trioshed processes over the stand-in upstream
(:mod:`bench.standin`: the proxy is the only limit), both with a keys file whose key has a token
budget (so each request also asks the ledger), one recording usage to SQLite and one not, and
runs blocks of streamed one-token requests (per-request cost: where usage is recorded) and
64-token streams at c=1 and c=16, rounds interleaved (on, off, then off, on). Reported: each
target's process CPU per request (median over rounds) and the on/off ratio; target: no
measurable difference (ratio within the rounds' own spread). Results: ``bench/results/<date>-usage-overhead.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from bench import procs, relay
from bench.standin import BURST_ENV, write_wrapper

KEY = "bench-usage-key-1"


async def run(*, rounds: int = 5, requests: int = 200, concurrency: Sequence[int] = (1, 16), tokens: Sequence[int] = (1, 64),
              start: Sequence[str] = ("on", "off"), usage_off: bool = False, say: Any = print) -> dict[str, Any]:  # fmt: skip
    """``start``: the order the two processes start in (a check for position effects);
    ``usage_off``: both off (an A/A run: the noise floor of the comparison)."""
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="usage-bench-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        keys = base / "keys.toml"
        keys.write_text(f'[[key]]\nname = "bench"\nkey = "{KEY}"\ntokens_per_day = 1000000000\n')
        wrapper = write_wrapper(base)
        flags = procs.RunnerFlags(parallel=max(concurrency), ctx_per_slot=128)
        servers = {}
        async with AsyncExitStack() as stack:
            for name in start:
                on = "true" if name == "on" and not usage_off else "false"
                env = {"TRIOSHED_LLAMA_SERVER": str(wrapper), "TRIOSHED_MAX_CONNECTIONS": "1024", BURST_ENV: "1",
                       "TRIOSHED_USAGE": on, "TRIOSHED_USAGE_DB": str(base / f"usage-{name}.db"), "TRIOSHED_KEYS_FILE": str(keys)}  # fmt: skip
                servers[name] = await stack.enter_async_context(
                    procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=env, ready_path="/ui")
                )
            relay.AUTH_HEADER = f"Authorization: Bearer {KEY}\r\n".encode()
            ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in servers.items()}
            for n in servers:  # warm: runner loaded, paths imported
                await relay.run_block(ports[n], servers[n].pid, "ollama-generate", "tiny", 1, 4, 8)
            rows = []
            for protocol in ("ollama-generate", "openai-chat"):
                for c in concurrency:
                    for n_tokens in tokens:
                        per: dict[str, list[float]] = {"on": [], "off": []}
                        failed = 0
                        for r in range(rounds):
                            for n in ("on", "off") if r % 2 == 0 else ("off", "on"):
                                block = await relay.run_block(ports[n], servers[n].pid, protocol, "tiny", c, n_tokens, requests)
                                failed += block.failed
                                per[n].append(block.cpu_s / block.requests * 1e6)
                        on, off = statistics.median(per["on"]), statistics.median(per["off"])
                        spread = statistics.pstdev(per["off"]) / off if off else 0.0
                        row = {"protocol": protocol, "concurrency": c, "tokens": n_tokens, "cpu_us_per_request_on": round(on, 1),
                               "cpu_us_per_request_off": round(off, 1), "ratio": round(on / off, 3) if off else None,
                               "off_spread": round(spread, 3), "failed": failed}  # fmt: skip
                        rows.append(row)
                        say(f"usage {protocol:16s} c={c:<3d} tokens={n_tokens:<3d} on {on:8.1f} us/req  off {off:8.1f} us/req  "
                            f"ratio {row['ratio']}  (off's spread {spread:.1%})  failed {failed}")  # fmt: skip
            written = servers["on"]
        return {"rows": rows, "rounds": rounds, "requests": requests, "server": str(written.base_url),
                "start": list(start), "usage_off": usage_off}


def in_process(n: int = 200_000) -> dict[str, float]:
    """The hot path's own share, in-process: recording one finished request (ledger + row kept for
    the writer) and asking the ledger before one, with a minute window of ``n`` spends; and one
    batch of 1,000 rows written to SQLite (the writer's thread, once a second)."""
    from trioshed.keys import ApiKey
    from trioshed.trace import RequestTrace
    from trioshed.usage.db import UsageDB
    from trioshed.usage.recorder import UsageRecorder

    with tempfile.TemporaryDirectory(prefix="usage-micro-") as tmp:
        recorder = UsageRecorder(Path(tmp) / "u.db", bound=n)
        trace = RequestTrace("POST", "/api/chat", "", 0.0, model="tiny:latest", key="ann", status=200,
                             prompt_tokens=20, eval_tokens=64, cached_tokens=10, prompt_seconds=0.01, eval_seconds=0.1)  # fmt: skip
        key = ApiKey("ann", "12345678", tokens_per_minute=10**12, tokens_per_day=10**12)
        c0 = time.process_time()
        for _ in range(n):
            recorder.record_trace(trace)
        c1 = time.process_time()
        for _ in range(n):
            recorder.ledger.refusal(key, time.time())
        c2 = time.process_time()
        db = UsageDB(Path(tmp) / "batch.db")
        batch = recorder.pending[:1000]
        c3 = time.process_time()
        for _ in range(20):
            db.write(batch, time.time())
        c4 = time.process_time()
        db.close()
    return {"record_us": round((c1 - c0) / n * 1e6, 2), "budget_check_us": round((c2 - c1) / n * 1e6, 2),
            "batch_1000_ms": round((c4 - c3) / 20 * 1e3, 2)}  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Usage recording on vs off ({time.strftime('%Y-%m-%d')})",
        "",
        "trioshed over the stand-in upstream, two processes side by side (usage to SQLite on / off), a key with a",
        f"token budget on both; {doc['rounds']} interleaved rounds of {doc['requests']} streamed requests per cell;",
        f"started in the order {', '.join(doc['start'])}" + ("; an A/A run: usage off in both, the comparison's noise floor" if doc["usage_off"] else "") + ";",
        "process CPU per request, median over rounds. Target: no measurable difference (ratio within the spread).",
        "",
        "| protocol | c | tokens | on (us/req) | off (us/req) | on/off | off's spread | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['protocol']} | {r['concurrency']} | {r['tokens']} | {r['cpu_us_per_request_on']} | "
                     f"{r['cpu_us_per_request_off']} | {r['ratio']} | {r['off_spread']:.1%} | {r['failed']} |")  # fmt: skip
    m = doc["in_process"]
    lines += ["", "In-process, the hot path's own share (no HTTP, no processes):", "",
              f"- recording a finished request (ledger + the row kept for the writer): {m['record_us']} us",
              f"- asking the ledger before a request (two budgets, 200,000 spends in the minute window): {m['budget_check_us']} us",
              f"- writing a batch of 1,000 rows to SQLite (the writer's worker thread, once a second): {m['batch_1000_ms']} ms CPU"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--start", choices=("on", "off"), default="on", help="which process starts first")
    parser.add_argument("--aa", action="store_true", help="usage off in both (the comparison's noise floor)")
    parser.add_argument("--name", default="usage-overhead", help="the results file's name after the date")
    args = parser.parse_args(argv)
    start = ("on", "off") if args.start == "on" else ("off", "on")
    doc = trio.run(lambda: run(rounds=args.rounds, requests=args.requests, tokens=args.tokens, start=start, usage_off=args.aa))
    doc["in_process"] = in_process()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{time.strftime('%Y-%m-%d')}-{args.name}.md"
    path.write_text(markdown(doc))
    print(f"wrote {path}", file=sys.stderr)
    return 1 if any(r["failed"] for r in doc["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
