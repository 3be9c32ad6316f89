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

The client is a raw Trio socket (no HTTP library) that reads each answer to its end and checks
that the final event arrived: its own cost is kept off trioshed's books. Each stream slot keeps
its connection alive across requests, as the official clients' connection pools do (httpx under
the ``openai``, ``ollama`` and ``anthropic`` SDKs); ``keepalive=False`` opens one per request
(``Connection: close``), which adds the server's accept and close to every request.
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
from bench.standin import BURST_ENV, write_wrapper

CONCURRENCY = (1, 16, 64, 256)
_REPO = str(Path(__file__).resolve().parent.parent)

#: protocol -> (path, body(model, n), the bytes that end a complete answer); the bytes that mark
#: one token in the answer are in TOKEN_MARKS (answers may end early at an end-of-sequence token)
PROTOCOLS: dict[str, tuple[str, Any, bytes]] = {
    "ollama-generate": ("/api/generate", lambda m, n: {"model": m, "prompt": "hi", "raw": True, "stream": True,
                                                       "options": {"num_predict": n}}, b'"done":true'),
    "ollama-chat": ("/api/chat", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                               "options": {"num_predict": n}}, b'"done":true'),
    "openai-chat": ("/v1/chat/completions", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                                          "stream": True, "max_tokens": n}, b"data: [DONE]"),
    "anthropic": ("/v1/messages", lambda m, n: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True, "max_tokens": n}, b"message_stop"),
    # llama-server's own streaming route, through llama.cpp's router (trioshed's raw generate
    # goes upstream to the same route)
    "native": ("/completion", lambda m, n: {"model": m, "prompt": "hi", "stream": True, "n_predict": n}, b'"stop":true'),
}  # fmt: skip
TOKEN_MARKS = {"ollama-generate": b'"done": false', "ollama-chat": b'"done": false', "openai-chat": b'"content":"',
               "anthropic": b'"text_delta"', "native": b'"stop":false'}  # fmt: skip
#: What trioshed serves (the router comparison adds "native").
TRIOSHED_PROTOCOLS = ("ollama-generate", "ollama-chat", "openai-chat", "anthropic")


@dataclass
class Block:
    protocol: str
    concurrency: int
    tokens: int  # per request, asked for
    requests: int
    failed: int
    wall_s: float
    cpu_s: float  # the proxy's process CPU over the block
    relayed: int = 0  # tokens counted in the answers

    @property
    def tokens_total(self) -> int:
        return self.relayed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_total / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens_total / self.cpu_s if self.cpu_s else 0.0


#: An ``Authorization: ...\r\n`` line every request sends (``bench.usage_overhead``: a server with keys)
AUTH_HEADER = b""


class KeptConnection:
    """One client connection used for request after request (reopened when the server closes it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None

    async def request(self, path: str, body: bytes, end: bytes, mark: bytes = b"\0", *, close: bool = False) -> tuple[bool, int]:
        """One streamed request; (complete, tokens counted by ``mark``). ``close``: ask for
        ``Connection: close`` and read on to the server's close (it must come, with no byte more)."""
        if self.stream is None:
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        stream = self.stream
        try:
            await stream.send_all(
                b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s%s\r\n%s"
                % (path.encode(), len(body), AUTH_HEADER, b"Connection: close\r\n" if close else b"", body)
            )
            head = b""
            while b"\r\n\r\n" not in head:
                data = await stream.receive_some(262144)
                if not data:
                    raise OSError("closed before the answer's head")
                head += data
            head, _, data = head.partition(b"\r\n\r\n")
            lower = head.lower()
            chunked = b"transfer-encoding: chunked" in lower
            length = 0 if chunked else int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            tail, tokens, got, keep = b"", 0, 0, len(mark) - 1
            while True:
                joined = tail[-keep:] + data if keep else data
                tokens += joined.count(mark)
                tail = (tail + data)[-4096:]
                got += len(data)
                if (chunked and tail.endswith(b"0\r\n\r\n")) or (not chunked and got >= length):
                    break
                data = await stream.receive_some(262144)
                if not data:
                    raise OSError("closed in the middle of the answer")
            if close and await stream.receive_some(262144):
                raise OSError("bytes after the answer on a closing connection")
        except BaseException:
            await self.aclose()
            raise
        if close or b"connection: close" in lower:
            await self.aclose()
        return end in tail.replace(b" ", b""), tokens


async def one_request(port: int, path: str, body: bytes, end: bytes, mark: bytes = b"\0") -> tuple[bool, int]:
    """One streamed request on a connection of its own (``Connection: close``), read to the close."""
    connection = KeptConnection(port)
    try:
        return await connection.request(path, body, end, mark, close=True)
    finally:
        await connection.aclose()


async def run_block(port: int, pid: int, protocol: str, model: str, concurrency: int, tokens: int, requests: int,
                    *, keepalive: bool = True) -> Block:  # fmt: skip
    path, make, end = PROTOCOLS[protocol]
    body = json.dumps(make(model, tokens)).encode()
    proc = psutil.Process(pid)
    failed = relayed = 0
    remaining = requests

    async def worker() -> None:
        nonlocal failed, remaining, relayed
        connection = KeptConnection(port)
        try:
            while remaining > 0:
                remaining -= 1
                try:
                    with trio.fail_after(120):
                        ok, n = await connection.request(path, body, end.replace(b" ", b""), TOKEN_MARKS[protocol], close=not keepalive)
                except (OSError, trio.TooSlowError):
                    ok, n = False, 0
                failed += not ok
                relayed += n
        finally:
            await connection.aclose()

    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)
    wall = time.perf_counter() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    return Block(protocol, concurrency, tokens, requests, failed, wall, cpu, relayed)


def _requests_for(concurrency: int, tokens: int, quick: bool) -> int:
    """Requests in a block: ~30k (quick) or 150k tokens, at most 400 / 2,000 requests, and every
    stream slot used twice."""
    total_tokens, most = (30_000, 400) if quick else (150_000, 2_000)
    return max(concurrency * 2, min(most, total_tokens // max(tokens, 1)))


async def _served(port: int, path: str) -> bool:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                              b"Connection: close\r\n\r\n{}" % path.encode())
        head = await stream.receive_some(64)
    return not head.startswith(b"HTTP/1.1 404")


async def measure(server_port: int, pid: int, model: str, *, tokens: int, protocols: Sequence[str],
                  concurrency: Sequence[int], quick: bool, say: Any = print, requests: int | None = None,
                  burst: int = 1) -> dict[str, Any]:  # fmt: skip
    """Every block for one running proxy; returns a JSON-able dict of rows."""
    rows: list[dict[str, Any]] = []
    for protocol in protocols:
        if not await _served(server_port, PROTOCOLS[protocol][0]):
            say(f"relay: {protocol} not served (404): skipped")
            continue
        await run_block(server_port, pid, protocol, model, 1, 4, 4)  # warm: the runner is loaded, paths imported
        for c in concurrency:
            short = await run_block(server_port, pid, protocol, model, c, 1, requests or _requests_for(c, 1, quick))
            long = await run_block(server_port, pid, protocol, model, c, tokens, requests or _requests_for(c, tokens, quick))
            per_req = short.cpu_s / max(short.requests, 1)  # a request with 1 token: ~all per-request cost
            per_tok = max(long.cpu_s - per_req * long.requests, 0.0) / max(long.tokens_total, 1)
            row = {
                "protocol": protocol, "concurrency": c, "tokens": tokens,
                "tokens_per_s": round(long.tokens_per_s), "tokens_per_cpu_s": round(long.tokens_per_cpu_s),
                "cpu_us_per_token_all_in": round(long.cpu_s / max(long.tokens_total, 1) * 1e6, 2),
                "cpu_us_per_token": round(per_tok * 1e6, 2), "cpu_us_per_request": round(per_req * 1e6, 1),
                "busy": round(long.cpu_s / long.wall_s, 2) if long.wall_s else 0.0, "burst": burst,
                "failed": long.failed + short.failed, "blocks": [asdict(short), asdict(long)],
            }  # fmt: skip
            rows.append(row)
            say(
                f"relay {protocol:16s} burst={burst:<3d} c={c:<4d} {row['tokens_per_s']:>8d} tok/s  {row['tokens_per_cpu_s']:>8d} tok/cpu-s  "
                f"{row['cpu_us_per_token']:>7.2f} us/token  {row['cpu_us_per_request']:>8.1f} us/request  failed {row['failed']}"
            )
    return {"rows": rows}


async def run(*, tokens: int = 256, quick: bool = True, protocols: Sequence[str] = TRIOSHED_PROTOCOLS,
              concurrency: Sequence[int] = CONCURRENCY, work: Path | None = None, requests: int | None = None,
              burst: int = 1, say: Any = print) -> dict[str, Any]:  # fmt: skip
    """trioshed over the stand-in: the relay table."""
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="relay-") as tmp:
        base = Path(work or tmp)
        models = base / "models"
        models.mkdir(parents=True, exist_ok=True)
        write_tiny_model(models / "tiny.gguf")
        wrapper = write_wrapper(base)
        flags = procs.RunnerFlags(parallel=max(concurrency), ctx_per_slot=64)
        env = {
            "TRIOSHED_LLAMA_SERVER": str(wrapper),
            "TRIOSHED_MAX_CONNECTIONS": "1024",
            BURST_ENV: str(burst),
        }
        async with procs.open_trioshed(
            models, flags, base / "logs", max_loaded=1, extra_env=env
        ) as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            result = await measure(port, server.pid, "tiny", tokens=tokens, protocols=protocols,
                                   concurrency=concurrency, quick=quick, requests=requests, say=say, burst=burst)  # fmt: skip
        result["upstream"] = _upstream_words(burst)
        result["burst"] = burst
        return result


async def run_real(*, tokens: int = 256, concurrency: Sequence[int] = (16, 64), requests: int = 64,
                   work: Path | None = None, say: Any = print) -> dict[str, Any]:  # fmt: skip
    """trioshed and llama.cpp's router over the real llama-server on a tiny model (one thread,
    ``max(concurrency)`` slots): tokens arrive one per event as the model makes them, so each is
    its own read: the per-token cost of a proxy that is not saturated. Each proxy's own process
    CPU (its children excluded)."""
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="relay-real-") as tmp:
        base = Path(work or tmp)
        models = base / "models"
        models.mkdir(parents=True, exist_ok=True)
        write_tiny_model(models / "tiny.gguf")
        flags = procs.RunnerFlags(parallel=max(concurrency), ctx_per_slot=tokens + 64)
        rows: list[dict[str, Any]] = []
        targets = (
            ("trioshed", lambda: procs.open_trioshed(models, flags, base / "logs", max_loaded=1), ("ollama-generate", "openai-chat")),
            ("router", lambda: procs.open_router(models, 1, flags, base / "logs"), ("native", "openai-chat")),
        )  # fmt: skip
        for name, opener, protos in targets:
            async with opener() as server:
                port = int(server.base_url.rsplit(":", 1)[1])
                for protocol in protos:
                    await run_block(port, server.pid, protocol, "tiny", 1, 4, 4)  # loads the model
                    for c in concurrency:
                        block = await run_block(port, server.pid, protocol, "tiny", c, tokens, requests)
                        row = {"proxy": name, "protocol": protocol, "concurrency": c, "tokens_per_s": round(block.tokens_per_s),
                               "cpu_us_per_token_all_in": round(block.cpu_s / max(block.tokens_total, 1) * 1e6, 1),
                               "failed": block.failed}  # fmt: skip
                        rows.append(row)
                        say(f"relay (real llama-server) {name:8s} {protocol:16s} c={c:<3d} {row['tokens_per_s']:>6d} tok/s  "
                            f"{row['cpu_us_per_token_all_in']:>6.1f} us CPU per token (all in)  failed {block.failed}")
        return {"rows": rows, "upstream": f"llama-server tiny model, -t 1, {max(concurrency)} slots"}


def _upstream_words(burst: int) -> str:
    if burst <= 1:
        return "bench.standin, one event per write as llama-server writes them"
    return f"bench.standin, {burst} events per write: the upstream outruns the relay"


def table(result: dict[str, Any]) -> str:
    lines = ["| protocol | streams | tokens/s (wall) | tokens per CPU-second | CPU us/token | CPU us/request | relay busy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['protocol']} | {r['concurrency']} | {r['tokens_per_s']:,} | {r['tokens_per_cpu_s']:,} | "
                     f"{r['cpu_us_per_token']:.1f} | {r['cpu_us_per_request']:.0f} | {r.get('busy', 0):.0%} |")
    return "\n".join(lines)


async def _raw_relay_connection(upstream_port: int, client: trio.SocketStream) -> None:
    """Forward each request to the upstream and its answer back, bytes as they come: what a
    relay costs in Python and Trio with no HTTP library (the floor under every proxy here).
    The stand-in closes its connection after each streamed answer, which ends the answer here."""
    async with client:
        while True:
            request = b""
            while b"\r\n\r\n" not in request or len(request) < request.index(b"\r\n\r\n") + 4 + _length(request):
                data = await client.receive_some(65536)
                if not data:
                    return
                request += data
            upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
            async with upstream:
                await upstream.send_all(request)
                while data := await upstream.receive_some(65536):
                    await client.send_all(data)


def _length(request: bytes) -> int:
    head = request.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


async def serve_raw_relay(upstream_port: int, port: int) -> None:
    from functools import partial

    await trio.serve_tcp(partial(_raw_relay_connection, upstream_port), port, host="127.0.0.1")


async def run_floor(*, tokens: int = 256, concurrency: Sequence[int] = CONCURRENCY, quick: bool = True,
                    work: Path | None = None, say: Any = print, burst: int = 1) -> dict[str, Any]:  # fmt: skip
    """The stand-in behind the raw relay (no HTTP library), on llama-server's own route: the
    per-token and per-request floor of any Python/Trio relay on this machine."""
    with tempfile.TemporaryDirectory(prefix="relay-floor-") as tmp:
        base = Path(work or tmp)
        up_port, port = procs.free_port(), procs.free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_REPO, env.get("PYTHONPATH", "")])
        env[BURST_ENV] = str(burst)
        async with procs.open_server("standin", [sys.executable, "-m", "bench.standin", "--port", str(up_port)], env=env,
                                     base_url=f"http://127.0.0.1:{up_port}", ready_path="/health", log_path=base / "standin.log"), \
                procs.open_server("raw-relay", [sys.executable, "-m", "bench.relay", "--raw-relay", str(up_port), str(port)], env=env,
                                  base_url=f"http://127.0.0.1:{port}", ready_path="/health", log_path=base / "relay.log") as relay:  # fmt: skip
            rows = []
            for c in concurrency:
                short = await run_block(port, relay.pid, "native", "tiny", c, 1, _requests_for(c, 1, quick))
                long = await run_block(port, relay.pid, "native", "tiny", c, tokens, _requests_for(c, tokens, quick))
                per_req = short.cpu_s / max(short.requests, 1)
                per_tok = max(long.cpu_s - per_req * long.requests, 0.0) / max(long.tokens_total, 1)
                row = {"protocol": "raw relay", "concurrency": c, "tokens": tokens, "tokens_per_s": round(long.tokens_per_s),
                       "tokens_per_cpu_s": round(long.tokens_per_cpu_s), "cpu_us_per_token": round(per_tok * 1e6, 2),
                       "cpu_us_per_request": round(per_req * 1e6, 1), "failed": long.failed + short.failed,
                       "busy": round(long.cpu_s / long.wall_s, 2) if long.wall_s else 0.0, "burst": burst}  # fmt: skip
                rows.append(row)
                say(
                    f"relay floor (raw) burst={burst:<3d} c={c:<4d} {row['tokens_per_s']:>8d} tok/s  {row['tokens_per_cpu_s']:>8d} tok/cpu-s  "
                    f"{row['cpu_us_per_token']:>7.2f} us/token  {row['cpu_us_per_request']:>8.1f} us/request"
                )
        return {"rows": rows, "upstream": _upstream_words(burst), "burst": burst}


#: The relay targets: tokens one trioshed process relays per CPU-second.
TARGETS = {"openai-chat": 100_000, "ollama-generate": 50_000, "ollama-chat": 50_000}


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Met / not met, from a :func:`run_all` document."""
    out = []
    best: dict[str, int] = {}
    ceiling = "saturated" if "saturated" in doc else "standin"  # the ceiling: the proxy the only limit
    for r in doc.get(ceiling, {}).get("rows", []):
        best[r["protocol"]] = max(best.get(r["protocol"], 0), r["tokens_per_cpu_s"])
    floor_rows = doc.get("floor_saturated" if ceiling == "saturated" else "floor", {}).get("rows", [])
    floor = max((r["tokens_per_cpu_s"] for r in floor_rows), default=None)
    for protocol, target in TARGETS.items():
        if protocol in best:
            out.append({"target": f"{protocol}: >= {target:,} relayed tokens per CPU-second", "value": best[protocol],
                        "met": best[protocol] >= target, "floor": floor})  # fmt: skip
    real = {(r["proxy"], r["protocol"], r["concurrency"]): r for r in doc.get("real", {}).get("rows", [])}
    for (proxy, protocol, c), row in real.items():
        mate = real.get(("router", ROUTER_PROTOCOL.get(protocol, ""), c))
        if proxy != "trioshed" or mate is None:
            continue
        us, router_us = row["cpu_us_per_token_all_in"], mate["cpu_us_per_token_all_in"]
        out.append({"target": f"CPU per relayed token, {protocol} (real llama-server, {c} streams) <= 1.25x the router's",
                    "value": us, "router": router_us, "met": us <= 1.25 * router_us})  # fmt: skip
        if c == 16:
            tok, router_tok = row["tokens_per_s"], mate["tokens_per_s"]
            out.append({"target": f"aggregate tokens/s, {protocol} (real llama-server, 16 streams) >= 0.95x the router's",
                        "value": tok, "router": router_tok, "met": tok >= 0.95 * router_tok})  # fmt: skip
    return out


#: The router's stream each of trioshed's is compared with: llama-server's own streaming route
#: (trioshed's raw generate relays it) and the same OpenAI route.
ROUTER_PROTOCOL = {"ollama-generate": "native", "openai-chat": "openai-chat"}


#: Stand-in events per write for the ceiling: a relay 32 events behind (TCP keeps no write
#: boundaries, so this is what a relay that falls behind a fast upstream reads).
SATURATED = 32


async def run_all(*, quick: bool = True, say: Any = print) -> dict[str, Any]:
    """The stand-in tables (event by event, and saturated: the ceiling), the raw-relay floor of
    each, and trioshed vs the router on the real binary."""
    return {
        "standin": await run(quick=quick, say=say),
        "saturated": await run(quick=quick, say=say, burst=SATURATED),
        "floor": await run_floor(quick=quick, say=say),
        "floor_saturated": await run_floor(quick=quick, say=say, burst=SATURATED),
        "real": await run_real(requests=48 if quick else 160, say=say),
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"### Relay ceiling: trioshed over a stand-in llama-server writing {SATURATED} events per write (the upstream outruns the relay)", "",
             table(doc["saturated"]), "",
             f"The floor: a raw Trio relay with no HTTP library over the same stand-in ({SATURATED} events per write, llama-server's /completion):", "",
             table(doc["floor_saturated"]), "",
             "### Event by event: the stand-in writes one event per write, as llama-server does", "",
             table(doc["standin"]), "", "The raw relay, one event per write:", "", table(doc["floor"]), "",
             "### Real llama-server (tiny model): trioshed and llama.cpp's router, each process's own CPU", "",
             real_table(doc["real"]), "", "| target | value | met |", "| --- | ---: | --- |"]  # fmt: skip
    for t in targets(doc):
        extra = f" (router {t['router']})" if "router" in t else (f" (raw relay floor {t['floor']:,})" if t.get("floor") else "")
        lines.append(f"| {t['target']} | {t['value']:,}{extra} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def real_table(result: dict[str, Any]) -> str:
    lines = ["| proxy | protocol | streams | tokens/s (wall) | CPU us per token, all in |", "| --- | --- | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['proxy']} | {r['protocol']} | {r['concurrency']} | {r['tokens_per_s']:,} | {r['cpu_us_per_token_all_in']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--full", action="store_true", help="larger samples")
    parser.add_argument("--protocol", action="append", choices=list(PROTOCOLS))
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--all", action="store_true", help="also the raw-relay floor and trioshed vs the router on the real binary")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--burst",
        type=int,
        default=1,
        help="stand-in events per write (default 1, as llama-server)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="the raw relay (no HTTP library) instead of trioshed"
    )
    parser.add_argument(
        "--raw-relay", nargs=2, type=int, metavar=("UPSTREAM_PORT", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.raw_relay:
        trio.run(serve_raw_relay, *args.raw_relay)
        return 0
    if args.all:
        result = trio.run(lambda: run_all(quick=not args.full))
        print(markdown(result))
    elif args.floor:
        result = trio.run(lambda: run_floor(tokens=args.tokens, quick=not args.full, concurrency=args.concurrency or CONCURRENCY,
                                            burst=args.burst))  # fmt: skip
        print(table(result))
    else:
        result = trio.run(lambda: run(tokens=args.tokens, quick=not args.full, protocols=args.protocol or TRIOSHED_PROTOCOLS,
                                      concurrency=args.concurrency or CONCURRENCY, burst=args.burst))  # fmt: skip
        print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
