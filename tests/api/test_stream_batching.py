"""Under load, streamed answers are read from their runners in batches (StreamBatching).

Under Trio's MockClock: each stand-in runner makes one token a millisecond, and a read takes
everything that arrived since the last one, as a socket read does. What must hold: every token
arrives, in order; the first piece is never held; below the threshold every token is its own
read; from it, after its first reads, each stream reads about once per its share of the
process's read rate, and a short answer is never held; the count
of streams returns to zero however a stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from trioshed.api.pipeline import upstream
from trioshed.api.pipeline.upstream import (
    EAGER_READS,
    READS_PER_SECOND,
    StreamBatching,
    _bounded_pieces,
)

TOKENS = 100
EVERY = 0.001  # seconds between two tokens of one stream


@dataclass
class _Model:
    name: str = "tiny"


@dataclass
class _Lease:
    """What a bounded read needs of a lease: its model's name and a sign of life."""

    model: _Model = field(default_factory=_Model)
    produced_count: int = 0

    def produced(self) -> None:
        self.produced_count += 1

    def evict(self, reason: str) -> None:  # pragma: no cover - only a stalled read evicts
        raise AssertionError(reason)


class _Runner:
    """One streamed answer: a token every EVERY seconds; a read returns all that arrived."""

    def __init__(self, tokens: int = TOKENS) -> None:
        self.tokens = tokens
        self.arrived: list[bytes] = []
        self.taken = 0
        self.done = False
        self.wake = trio.Event()

    async def produce(self) -> None:
        for i in range(self.tokens):
            await trio.sleep(EVERY)
            self.arrived.append(b"%d," % i)
            self.wake.set()
        self.done = True
        self.wake.set()

    @property
    def complete(self) -> bool:
        return self.done and self.taken == len(self.arrived)

    def abort(self) -> None:
        """As a closed connection (``UpstreamAnswer.abort``): no more arrives. Nothing stalls here."""
        self.done = True
        self.wake.set()

    async def pieces(self) -> AsyncIterator[bytes]:
        while True:
            while self.taken == len(self.arrived) and not self.done:
                self.wake = trio.Event()
                await self.wake.wait()
            if self.taken == len(self.arrived):
                return
            piece = b"".join(self.arrived[self.taken :])
            self.taken = len(self.arrived)
            yield piece


@dataclass
class _Seen:
    pieces: list[bytes] = field(default_factory=list)
    first_at: float = 0.0
    ended_at: float = 0.0


async def _stream(seen: _Seen, started: float, tokens: int) -> None:
    runner = _Runner(tokens)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.produce)
        async with aclosing(runner.pieces()) as source:
            first = await source.__anext__()
            seen.first_at = trio.current_time() - started
            async with aclosing(_bounded_pieces(_Lease(), source, first, runner)) as pieces:  # type: ignore[arg-type]
                async for piece in pieces:
                    seen.pieces.append(piece)
            seen.ended_at = trio.current_time() - started


async def _streams(count: int, tokens: int = TOKENS) -> list[_Seen]:
    seen = [_Seen() for _ in range(count)]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for s in seen:
            nursery.start_soon(_stream, s, started, tokens)
    return seen


@pytest.fixture
def policy(monkeypatch: pytest.MonkeyPatch) -> StreamBatching:
    fresh = StreamBatching(window=0.05, from_streams=8)
    monkeypatch.setattr(upstream, "batching", fresh)
    return fresh


def _expected(tokens: int = TOKENS) -> bytes:
    return b"".join(b"%d," % i for i in range(tokens))


def test_the_hold_grows_with_the_streams_up_to_the_window() -> None:
    policy = StreamBatching(window=0.05, from_streams=8)
    for streams, hold in ((0, 0.0), (7, 0.0), (8, 8 / READS_PER_SECOND), (16, 16 / READS_PER_SECOND), (64, 0.05)):
        policy.streams = streams
        assert policy.hold() == pytest.approx(hold), streams
    policy.window = 0.0
    policy.streams = 64
    assert policy.hold() == 0.0


async def test_below_the_threshold_every_token_is_its_own_read(autojump_clock: trio.testing.MockClock, policy: StreamBatching) -> None:
    seen = await _streams(7)
    for s in seen:
        assert b"".join(s.pieces) == _expected()
        assert len(s.pieces) == TOKENS
    assert policy.streams == 0


async def test_from_the_threshold_each_stream_reads_once_per_its_share(autojump_clock: trio.testing.MockClock, policy: StreamBatching) -> None:
    seen = await _streams(16)
    hold = 16 / READS_PER_SECOND  # 16 ms: about 16 tokens a read
    for s in seen:
        assert b"".join(s.pieces) == _expected()
        # the first reads as they come, each one token; then about one read per hold, where
        # each token was one read (and one more at the end)
        assert s.pieces[:EAGER_READS] == [b"%d," % i for i in range(EAGER_READS)]
        assert len(s.pieces) <= EAGER_READS + (TOKENS - EAGER_READS) * EVERY / hold + 2
        assert max(len(p.split(b",")) - 1 for p in s.pieces) >= 10
        assert s.ended_at <= TOKENS * EVERY + hold  # the end waits at most one hold, once
    assert policy.streams == 0


async def test_a_short_answer_is_never_held(autojump_clock: trio.testing.MockClock, policy: StreamBatching) -> None:
    seen = await _streams(16, tokens=EAGER_READS)
    for s in seen:
        assert s.pieces == [b"%d," % i for i in range(EAGER_READS)]
        assert s.ended_at == pytest.approx(EAGER_READS * EVERY)
    assert policy.streams == 0


async def test_off_when_the_window_is_zero(autojump_clock: trio.testing.MockClock, policy: StreamBatching) -> None:
    policy.window = 0.0
    seen = await _streams(16)
    assert all(len(s.pieces) == TOKENS for s in seen)


async def test_a_consumer_that_leaves_mid_answer_is_no_longer_counted(autojump_clock: trio.testing.MockClock, policy: StreamBatching) -> None:
    runner = _Runner()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.produce)
        async with aclosing(runner.pieces()) as source:
            first = await source.__anext__()
            async with aclosing(_bounded_pieces(_Lease(), source, first, runner)) as pieces:  # type: ignore[arg-type]
                assert await pieces.__anext__() == first
                await pieces.__anext__()
                assert policy.streams == 1
            assert policy.streams == 0  # closed by its consumer
            with trio.move_on_after(1):
                async with aclosing(_bounded_pieces(_Lease(), source, b"x", runner)) as pieces:  # type: ignore[arg-type]
                    await pieces.__anext__()
                    await pieces.__anext__()
                    assert policy.streams == 1
                    await trio.sleep_forever()
            assert policy.streams == 0  # cancelled
        nursery.cancel_scope.cancel()
