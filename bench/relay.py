"""The relay ceiling: how many streamed tokens one trioshed process relays, and at what CPU cost.

``python -m bench.relay`` (also the ``relay`` group of ``bench.compare``) starts trioshed over a
stand-in upstream (:mod:`bench.standin`, which writes its events as fast as it can, so the proxy
is the only limit) and runs blocks of streamed requests at 1, 16, 64 and 256 concurrent streams
for each protocol: Ollama's NDJSON (``/api/generate`` raw, relayed from llama-server's
``/completion``; ``/api/chat``, from ``/v1/chat/completions``), OpenAI's SSE
(``/v1/chat/completions``) and, where trioshed serves it, Anthropic's (``/v1/messages``).

What is measured, per block:
- trioshed's own process CPU time (user + system, from ``/proc`` via psutil) across the block:
  stable on a noisy machine, unlike wall time; per relayed token and per request;
- wall time, so tokens/s at that concurrency (bounded also by the client and the stand-in, which
  share the machine: read the CPU figures for the proxy's own cost).

Per-request and per-token costs are separated with two stream lengths (1 and ``tokens``): CPU =
requests x a + tokens x b, solved from the two blocks at each concurrency.

The client is a raw Trio socket per request (``Connection: close``, no HTTP library) that reads
to the end and checks that the final event arrived: its own cost is kept off trioshed's books.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import trio

from bench import procs
from bench.standin import write_wrapper

CONCURRENCY = (1, 16, 64, 256)

#: protocol -> (path, body(model, n), the bytes that end a complete answer)
PROTOCOLS: dict[str, tuple[str, Any, bytes]] = {
    "ollama-generate": ("/api/generate", lambda m, n: {"model": m, "prompt": "hi", "raw": True, "stream": True,
                                                       "options": {"num_predict": n}}, b'"done":true'),
    "ollama-chat": ("/api/chat", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                               "options": {"num_predict": n}}, b'"done":true'),
    "openai-chat": ("/v1/chat/completions", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                                          "stream": True, "max_tokens": n}, b"data: [DONE]"),
    "anthropic": ("/v1/messages", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True, "max_tokens": n}, b"message_stop"),
}  # fmt: skip


@dataclass
class Block:
    protocol: str
    concurrency: int
    tokens: int  # per request
    requests: int
    failed: int
    wall_s: float
    cpu_s: float  # the proxy's process CPU over the block

    @property
    def tokens_total(self) -> int:
        return self.tokens * (self.requests - self.failed)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_total / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens_total / self.cpu_s if self.cpu_s else 0.0


async def one_request(port: int, path: str, body: bytes, end: bytes) -> bool:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        tail = b""
        while data := await stream.receive_some(262144):
            tail = (tail + data)[-4096:]
        return end in tail.replace(b" ", b"")


async def run_block(port: int, pid: int, protocol: str, model: str, concurrency: int, tokens: int, requests: int) -> Block:
    path, make, end = PROTOCOLS[protocol]
    body = json.dumps(make(model, tokens)).encode()
    proc = psutil.Process(pid)
    failed = 0
    remaining = requests

    async def worker() -> None:
        nonlocal failed, remaining
        while remaining > 0:
            remaining -= 1
            try:
                with trio.fail_after(120):
                    ok = await one_request(port, path, body, end.replace(b" ", b""))
            except (OSError, trio.TooSlowError):
                ok = False
            failed += not ok

    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)
    wall = time.perf_counter() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    return Block(protocol, concurrency, tokens, requests, failed, wall, cpu)


def _requests_for(concurrency: int, tokens: int, quick: bool) -> int:
    total_tokens = 60_000 if quick else 200_000
    return max(concurrency * 2, min(4000, total_tokens // max(tokens, 1)))


async def _served(port: int, path: str) -> bool:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}" % path.encode())
        head = await stream.receive_some(64)
    return not head.startswith(b"HTTP/1.1 404")


async def measure(server_port: int, pid: int, model: str, *, tokens: int, protocols: Sequence[str],
                  concurrency: Sequence[int], quick: bool, say: Any = print) -> dict[str, Any]:  # fmt: skip
    """Every block for one running proxy; returns a JSON-able dict of rows."""
    rows: list[dict[str, Any]] = []
    for protocol in protocols:
        if not await _served(server_port, PROTOCOLS[protocol][0]):
            say(f"relay: {protocol} not served (404): skipped")
            continue
        await run_block(server_port, pid, protocol, model, 1, 4, 4)  # warm: the runner is loaded, paths imported
        for c in concurrency:
            short = await run_block(server_port, pid, protocol, model, c, 1, _requests_for(c, 16, quick))
            long = await run_block(server_port, pid, protocol, model, c, tokens, _requests_for(c, tokens, quick))
            per_req = short.cpu_s / max(short.requests, 1)  # a request with 1 token: ~all per-request cost
            per_tok = max(long.cpu_s - per_req * long.requests, 0.0) / max(long.tokens_total, 1)
            row = {
                "protocol": protocol, "concurrency": c, "tokens": tokens,
                "tokens_per_s": round(long.tokens_per_s), "tokens_per_cpu_s": round(long.tokens_per_cpu_s),
                "cpu_us_per_token_all_in": round(long.cpu_s / max(long.tokens_total, 1) * 1e6, 2),
                "cpu_us_per_token": round(per_tok * 1e6, 2), "cpu_us_per_request": round(per_req * 1e6, 1),
                "failed": long.failed + short.failed, "blocks": [asdict(short), asdict(long)],
            }  # fmt: skip
            rows.append(row)
            say(f"relay {protocol:16s} c={c:<4d} {row['tokens_per_s']:>8d} tok/s  {row['tokens_per_cpu_s']:>8d} tok/cpu-s  "
                f"{row['cpu_us_per_token']:>7.2f} us/token  {row['cpu_us_per_request']:>8.1f} us/request  failed {row['failed']}")
    return {"rows": rows}


async def run(*, tokens: int = 256, quick: bool = True, protocols: Sequence[str] = tuple(PROTOCOLS),
              concurrency: Sequence[int] = CONCURRENCY, work: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """trioshed over the stand-in: the relay table."""
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="relay-") as tmp:
        base = Path(work or tmp)
        models = base / "models"
        models.mkdir(parents=True, exist_ok=True)
        write_tiny_model(models / "tiny.gguf")
        wrapper = write_wrapper(base)
        flags = procs.RunnerFlags(parallel=max(concurrency), ctx_per_slot=64)
        env = {"TRIOSHED_LLAMA_SERVER": str(wrapper), "TRIOSHED_MAX_CONNECTIONS": "1024"}
        async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=env) as server:
            env_binary = server.argv  # noqa: F841 - kept for the record below
            port = int(server.base_url.rsplit(":", 1)[1])
            result = await measure(port, server.pid, "tiny", tokens=tokens, protocols=protocols,
                                   concurrency=concurrency, quick=quick)  # fmt: skip
        result["upstream"] = "bench.standin (events written back to back, one write each)"
        return result


def table(result: dict[str, Any]) -> str:
    lines = ["| protocol | streams | tokens/s (wall) | tokens per CPU-second | CPU us/token | CPU us/request |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['protocol']} | {r['concurrency']} | {r['tokens_per_s']:,} | {r['tokens_per_cpu_s']:,} | "
                     f"{r['cpu_us_per_token']:.1f} | {r['cpu_us_per_request']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--full", action="store_true", help="larger samples")
    parser.add_argument("--protocol", action="append", choices=list(PROTOCOLS))
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = trio.run(lambda: run(tokens=args.tokens, quick=not args.full, protocols=args.protocol or tuple(PROTOCOLS),
                                  concurrency=args.concurrency or CONCURRENCY))  # fmt: skip
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
