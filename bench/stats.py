"""Summaries of request records: percentiles, rates, errors by status. No I/O, no trio."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: A request slower than this (seconds, end to end) counts as a stall in the summary.
STALL_SECONDS = 5.0


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start`` is relative to the run's start.

    ``status`` is the HTTP status, or ``None`` when no complete answer came back ("lost":
    connection refused or reset, timeout, a stream cut before its final chunk).
    ``ttfb`` is the time to the first byte of the body, ``ttft`` to the first chunk carrying a
    token, ``total`` to the end of the body. ``tokens`` are the generated tokens, as reported
    by the server's final chunk when it reports them, else the chunks counted.
    """

    target: str
    model: str
    api: str
    start: float
    status: int | None = None
    error: str | None = None
    ttfb: float | None = None
    ttft: float | None = None
    total: float | None = None
    tokens: int = 0
    chunks: int = 0
    tag: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("start", "ttfb", "ttft", "total"):
            if d[key] is not None:
                d[key] = round(d[key], 6)  # microseconds are plenty, and halve the file
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    frac = rank - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


@dataclass
class Summary:
    """One block of requests against one target, reduced to the figures the tables show.

    Latencies are milliseconds; ``req_s`` counts answered (200) requests over ``wall`` seconds;
    ``tok_s`` is all generated tokens over ``wall``; ``stream_tok_s`` is the median over
    requests of (tokens - 1) / (total - ttft), the per-stream decode rate.
    """

    n: int
    ok: int
    lost: int
    by_status: dict[str, int]
    wall: float
    req_s: float
    tok_s: float
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    ttfb_p50: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    stream_tok_s: float | None
    stalls: int
    errors: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Iterable[RequestRecord], wall: float) -> Summary:
    recs = list(records)
    ok = [r for r in recs if r.ok]
    totals = [r.total for r in ok if r.total is not None]
    ttfbs = [r.ttfb for r in ok if r.ttfb is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    rates = [
        (r.tokens - 1) / (r.total - r.ttft)
        for r in ok
        if r.ttft is not None and r.total is not None and r.tokens > 1 and r.total > r.ttft
    ]
    by_status = Counter("lost" if r.status is None else str(r.status) for r in recs)
    errors = Counter((r.error or "")[:120] for r in recs if not r.ok)
    stalls = sum(1 for r in recs if r.total is not None and r.total > STALL_SECONDS)
    wall = max(wall, 1e-9)
    return Summary(
        n=len(recs),
        ok=len(ok),
        lost=by_status.get("lost", 0),
        by_status=dict(sorted(by_status.items())),
        wall=round(wall, 4),
        req_s=round(len(ok) / wall, 3),
        tok_s=round(sum(r.tokens for r in ok) / wall, 3),
        p50=_ms(percentile(totals, 50)),
        p90=_ms(percentile(totals, 90)),
        p99=_ms(percentile(totals, 99)),
        max=_ms(max(totals) if totals else None),
        ttfb_p50=_ms(percentile(ttfbs, 50)),
        ttft_p50=_ms(percentile(ttfts, 50)),
        ttft_p90=_ms(percentile(ttfts, 90)),
        stream_tok_s=None if not rates else round(percentile(rates, 50) or 0.0, 3),
        stalls=stalls,
        errors=dict(errors.most_common(5)),
    )


def paired_deltas(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> list[float]:
    """Per-pair latency differences ``b.total - a.total`` (seconds) for pairs where both succeeded.

    The overhead scenario sends request i to every target back to back, so pair i of two
    targets saw the same machine state; the median of these differences is the overhead.
    """
    out: list[float] = []
    for ra, rb in zip(a, b, strict=False):
        if ra.ok and rb.ok and ra.total is not None and rb.total is not None:
            out.append(rb.total - ra.total)
    return out


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base`` rounded, or ``None`` when either is missing or the base is zero."""
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)
