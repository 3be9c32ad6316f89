"""The load generator: N requests at concurrency C against one or more targets, on Trio + httpx.

Run it as ``python -m bench.load`` (or ``trioshed-bench``)::

    python -m bench.load --url http://127.0.0.1:11434 --model tiny -n 200 -c 4 --json out.json
    python -m bench.load --target a=http://127.0.0.1:8080,native --target b=http://127.0.0.1:11434 \\
        --scenarios bench/scenarios.toml --repeat 3

Per request it records the status, time to first byte, time to first token, total time and
tokens; per block it prints p50/p90/p99, req/s, tokens/s and errors by status, and ``--json``
writes every record. Several targets are interleaved (A B C, A B C, ...) so that drift on a
shared machine hits all of them alike.

Bounds: every request has a timeout, every block a deadline and a request count; only
loopback URLs are accepted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx
import trio

from bench.protocol import APIS, PATHS, parse_full_body, parse_stream_line, request_body
from bench.stats import RequestRecord, Summary, summarize

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a story about it"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
#: Cap on one block however many requests it was given (a runaway guard, not a tuning knob).
MAX_REQUESTS_PER_BLOCK = 100_000
#: Error bodies are cut to this many characters in the records.
ERROR_CHARS = 200


@dataclass(frozen=True)
class Target:
    """A server under test: a name for the tables, its base URL and the API to speak to it."""

    name: str
    base_url: str
    api: str = "ollama-generate"
    #: Per-model base URLs, for a target made of one server per model (direct llama-servers).
    model_urls: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_loopback(self.base_url)
        for _, url in self.model_urls:
            check_loopback(url)
        if self.api not in APIS:
            raise ValueError(f"unknown api {self.api!r} for {self.name}; expected one of {APIS}")

    def url_for(self, model: str) -> str:
        for name, url in self.model_urls:
            if name == model:
                return url.rstrip("/")
        return self.base_url.rstrip("/")


@dataclass(frozen=True)
class Scenario:
    """N requests at concurrency C, models taken round-robin from ``models``.

    ``timeout`` bounds each request and ``max_seconds`` the whole block (requests not yet
    finished then are recorded as lost). ``api``, when set, overrides the target's.
    ``duration`` turns the block into a timed one: no new request after that many seconds.
    """

    name: str
    models: tuple[str, ...]
    n: int = 20
    concurrency: int = 1
    n_predict: int = 8
    stream: bool = True
    prompt: str = DEFAULT_PROMPT
    timeout: float = 60.0
    max_seconds: float = 300.0
    api: str | None = None
    #: When set, workers start no new request after this many seconds (in-flight ones finish):
    #: a time-bounded block whose ``n`` is only a cap.
    duration: float | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError(f"scenario {self.name!r} names no model")
        if not 1 <= self.n <= MAX_REQUESTS_PER_BLOCK:
            raise ValueError(f"scenario {self.name!r}: n must be in 1..{MAX_REQUESTS_PER_BLOCK}")
        if self.concurrency < 1:
            raise ValueError(f"scenario {self.name!r}: concurrency must be >= 1")
        if not (self.timeout > 0 and self.max_seconds > 0):
            raise ValueError(f"scenario {self.name!r}: timeout and max_seconds must be > 0")


@dataclass
class Block:
    """The records of one scenario run once against one target."""

    scenario: str
    target: str
    round: int
    wall: float
    records: list[RequestRecord]
    summary: Summary = field(init=False)

    def __post_init__(self) -> None:
        self.summary = summarize(self.records, self.wall)

    def to_json(self, with_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "target": self.target,
            "round": self.round,
            "summary": self.summary.to_json(),
        }
        if with_records:
            out["records"] = [r.to_json() for r in self.records]
        return out


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"{url}: the harness only talks to loopback (127.0.0.1, localhost, ::1)")


def open_client(max_connections: int = 64) -> httpx.AsyncClient:
    """An httpx client for benchmarking: no retries, no proxies from the environment,
    ``TCP_NODELAY`` set explicitly (trio sets it too; without it keep-alive requests stall
    ~40 ms on Nagle + delayed ACK), enough pooled connections for the concurrency."""
    transport = httpx.AsyncHTTPTransport(
        verify=False,  # loopback HTTP only; skips building a TLS context (~90 ms here)
        retries=0,
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    )
    return httpx.AsyncClient(
        transport=transport,
        trust_env=False,
        timeout=httpx.Timeout(None),  # bounded by trio.fail_after per request instead
    )


async def one_request(
    client: httpx.AsyncClient,
    target: Target,
    scenario: Scenario,
    model: str,
    record: RequestRecord,
) -> None:
    """Send one request and fill ``record`` in place (so that a cancelled request leaves a
    partial record behind rather than none).

    Cancellation: a cancel from outside propagates; the caller marks unfinished records.
    """
    api = scenario.api or target.api
    url = target.url_for(model) + PATHS[api]
    body = request_body(api, model, scenario.prompt, scenario.n_predict, scenario.stream)
    t_start = time.perf_counter()
    try:
        with trio.fail_after(scenario.timeout):
            async with client.stream("POST", url, json=body) as resp:
                record.status = resp.status_code
                if resp.status_code != 200:
                    raw = await resp.aread()
                    record.total = time.perf_counter() - t_start
                    record.error = raw.decode("utf-8", "replace")[:ERROR_CHARS] or f"HTTP {resp.status_code}"
                    return
                if scenario.stream:
                    await _read_stream(resp, api, record, t_start)
                else:
                    raw = b""
                    async for piece in resp.aiter_bytes():
                        if record.ttfb is None:
                            record.ttfb = time.perf_counter() - t_start
                        raw += piece
                    record.total = time.perf_counter() - t_start
                    record.ttft = record.ttfb
                    tokens, error = parse_full_body(api, raw)
                    record.tokens = tokens or 0
                    record.error = error
    except trio.TooSlowError:
        record.status = None
        record.error = f"timeout after {scenario.timeout:g} s"
    except httpx.HTTPError as exc:
        record.status = None
        record.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]


async def _read_stream(
    resp: httpx.Response, api: str, record: RequestRecord, t_start: float
) -> None:
    buf = b""
    final = False
    reported: int | None = None
    async for piece in resp.aiter_bytes():
        now = time.perf_counter() - t_start
        if record.ttfb is None:
            record.ttfb = now
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            chunk = parse_stream_line(api, line)
            if chunk is None:
                continue
            record.chunks += 1
            if chunk.token:
                record.tokens += 1
                if record.ttft is None:
                    record.ttft = now
            if chunk.tokens is not None:
                reported = chunk.tokens
            if chunk.error is not None:
                record.error = chunk.error[:ERROR_CHARS]
            if chunk.final:
                final = True
    if buf.strip():
        chunk = parse_stream_line(api, buf)
        if chunk is not None and chunk.final:
            final = True
            if chunk.tokens is not None:
                reported = chunk.tokens
            if chunk.error is not None:
                record.error = chunk.error[:ERROR_CHARS]
    record.total = time.perf_counter() - t_start
    if reported is not None:
        record.tokens = reported
    if not final and record.error is None:
        # an answer cut before its last chunk is lost, whatever its status line said
        record.error = f"stream ended before its final chunk (HTTP {record.status})"
        record.status = None


class Progress:
    """A one-line progress bar on a terminal; silent otherwise (the per-block table follows)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.failed = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        if not record.ok:
            self.failed += 1
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            width = 24
            filled = int(width * self.done / max(self.total, 1))
            rate = self.done / max(now - self.t0, 1e-9)
            self.stream.write(
                f"\r{self.label:<28} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} err={self.failed} {rate:7.1f} req/s"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()


async def run_block(
    client: httpx.AsyncClient,
    target: Target,
    scenario: Scenario,
    *,
    t0: float,
    round: int = 0,
    on_record: Callable[[RequestRecord], None] | None = None,
    progress: bool = True,
    tag: str = "",
) -> Block:
    """Run ``scenario`` once against ``target``: ``n`` requests by ``concurrency`` workers.

    Bounded by ``scenario.n`` and ``scenario.max_seconds``; requests still in flight at the
    deadline are cancelled and recorded as lost.
    """
    n = scenario.n
    records: list[RequestRecord | None] = [None] * n
    next_index = 0
    bar = Progress(f"{scenario.name}/{target.name}", n) if progress else None
    api = scenario.api or target.api

    started = time.perf_counter()
    stop_at = math.inf if scenario.duration is None else started + scenario.duration

    async def worker() -> None:
        nonlocal next_index
        while next_index < n and time.perf_counter() < stop_at:
            i = next_index
            next_index += 1
            model = scenario.models[i % len(scenario.models)]
            rec = RequestRecord(
                target=target.name, model=model, api=api,
                start=time.perf_counter() - t0, tag=tag,
            )
            records[i] = rec
            await one_request(client, target, scenario, model, rec)
            if bar is not None:
                bar.update(rec)
            if on_record is not None:
                on_record(rec)

    with trio.move_on_after(scenario.max_seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(min(scenario.concurrency, n)):
                nursery.start_soon(worker)
    wall = time.perf_counter() - started
    if bar is not None:
        bar.close()
    done: list[RequestRecord] = []
    for rec in records:
        if rec is None:
            continue  # never started: the block's deadline came first
        if rec.total is None and rec.error is None:
            rec.status = None
            rec.error = f"cancelled at the block deadline ({scenario.max_seconds:g} s)"
        done.append(rec)
    return Block(scenario.name, target.name, round, wall, done)


async def run_interleaved(
    client: httpx.AsyncClient,
    targets: Sequence[Target],
    scenarios: Sequence[Scenario],
    *,
    repeat: int = 1,
    t0: float | None = None,
    progress: bool = True,
) -> list[Block]:
    """Every scenario against every target, ``repeat`` rounds, targets interleaved per round."""
    t0 = time.perf_counter() if t0 is None else t0
    blocks: list[Block] = []
    for scenario in scenarios:
        for r in range(repeat):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for target in order:
                blocks.append(
                    await run_block(client, target, scenario, t0=t0, round=r, progress=progress)
                )
    return blocks


# ---------------------------------------------------------------- tables


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def blocks_table(blocks: Sequence[Block]) -> str:
    """A markdown table, one row per block."""
    head = (
        "| scenario | target | round | n | ok | errors | p50 ms | p90 ms | p99 ms | "
        "req/s | tok/s | ttft p50 ms |\n"
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    rows = []
    for b in blocks:
        s = b.summary
        errs = ", ".join(f"{k}:{v}" for k, v in s.by_status.items() if k != "200") or "0"
        rows.append(
            f"| {b.scenario} | {b.target} | {b.round} | {s.n} | {s.ok} | {errs} | "
            f"{fmt(s.p50)} | {fmt(s.p90)} | {fmt(s.p99)} | {fmt(s.req_s)} | {fmt(s.tok_s)} | "
            f"{fmt(s.ttft_p50)} |"
        )
    return head + "\n".join(rows) + "\n"


# ---------------------------------------------------------------- CLI


def load_scenarios(path: Path, defaults: Scenario) -> list[Scenario]:
    """Scenarios from a TOML file: ``[[scenario]]`` tables whose keys are ``Scenario``'s fields;
    missing keys take the command line's values."""
    data = tomllib.loads(path.read_text())
    out = []
    allowed = set(Scenario.__dataclass_fields__)
    for i, table in enumerate(data.get("scenario", [])):
        unknown = set(table) - allowed
        if unknown:
            raise ValueError(f"{path}: scenario {i}: unknown keys {sorted(unknown)}")
        values = dict(table)
        if "models" in values:
            values["models"] = tuple(values["models"])
        values.setdefault("name", f"scenario{i}")
        out.append(replace(defaults, **values))
    if not out:
        raise ValueError(f"{path}: no [[scenario]] table")
    return out


def parse_target(text: str, default_api: str) -> Target:
    """``NAME=URL[,API]`` or a bare URL."""
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = "target", text
    url, _, api = rest.partition(",")
    return Target(name=name, base_url=url, api=api or default_api)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trioshed-bench",
        description="Load generator for trioshed, llama-server and anything speaking their APIs.",
    )
    p.add_argument("--url", help="base URL of one target (loopback only)")
    p.add_argument(
        "--target", action="append", default=[], metavar="NAME=URL[,API]",
        help="a target; repeat to interleave several",
    )
    p.add_argument("--api", default="ollama-generate", choices=APIS)
    p.add_argument("--model", action="append", default=[], help="model name; repeat for round-robin")
    p.add_argument("-n", "--requests", type=int, default=20)
    p.add_argument("-c", "--concurrency", type=int, default=1)
    p.add_argument("--n-predict", type=int, default=8)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--max-seconds", type=float, default=300.0, help="per block, seconds")
    p.add_argument("--repeat", type=int, default=1, help="rounds (targets interleaved per round)")
    p.add_argument("--scenarios", type=Path, help="TOML file of [[scenario]] tables")
    p.add_argument("--json", type=Path, help="write every record and summary here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = [parse_target(t, args.api) for t in args.target]
        if args.url:
            targets.append(Target("target", args.url, args.api))
        if not targets:
            raise ValueError("give --url or at least one --target")
        if len({t.name for t in targets}) != len(targets):
            raise ValueError("target names must be unique")
        defaults = Scenario(
            name="load",
            models=tuple(args.model) or ("default",),
            n=args.requests,
            concurrency=args.concurrency,
            n_predict=args.n_predict,
            stream=not args.no_stream,
            prompt=args.prompt,
            timeout=args.timeout,
            max_seconds=args.max_seconds,
        )
        if args.scenarios:
            scenarios = load_scenarios(args.scenarios, defaults)
        else:
            if not args.model:
                raise ValueError("give --model (or a --scenarios file naming models)")
            scenarios = [defaults]
        if not 1 <= args.repeat <= 1000:
            raise ValueError("--repeat must be in 1..1000")
    except (ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"trioshed-bench: {exc}", file=sys.stderr)
        return 2

    async def run() -> list[Block]:
        conc = max(s.concurrency for s in scenarios)
        async with open_client(max_connections=max(conc, 1)) as client:
            return await run_interleaved(
                client, targets, scenarios, repeat=args.repeat, progress=not args.no_progress
            )

    started = time.time()
    blocks = trio.run(run)
    print(blocks_table(blocks), end="")
    if args.json:
        doc = {
            "tool": "bench.load",
            "format": 1,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "targets": [asdict(t) for t in targets],
            "scenarios": [asdict(s) for s in scenarios],
            "blocks": [b.to_json() for b in blocks],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    failed = sum(b.summary.n - b.summary.ok for b in blocks)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
