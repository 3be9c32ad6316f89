"""A serving runner's output: a trickle is read in batches (each read wakes the event loop), a
flood at once (a child blocked on its full pipe stops serving), with Trio's MockClock."""

from __future__ import annotations

import trio
import trio.testing

from trioshed.core.model import ModelSpec, Placement, RunnerOptions
from trioshed.runner.output import OutputTail
from trioshed.runner.process import DRAIN_BATCH, DRAIN_PAUSE, LlamaServer


class Counted(trio.abc.ReceiveStream):
    """A child's output pipe, counting the reads."""

    def __init__(self, inner: trio.abc.ReceiveStream) -> None:
        self.inner = inner
        self.reads = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self.reads += 1
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _drain(pieces: list[bytes], every: float) -> tuple[int, float, list[str]]:
    """Write ``pieces`` to a serving runner's output, one each ``every`` seconds (mock time):
    the reads it took, how long after the last write the output was read to its end, the lines."""
    server = LlamaServer(ModelSpec("m:latest", "/nonexistent/m.gguf"), RunnerOptions(), Placement(0), 0)
    server._loaded = True  # ready: its output is no longer load progress
    send, receive = trio.testing.memory_stream_one_way_pair()
    pipe = Counted(receive)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._drain, pipe)
        for piece in pieces:
            await trio.sleep(every)
            await send.send_all(piece)
        last = trio.current_time()
        await send.aclose()
    return pipe.reads, trio.current_time() - last, server.tail.text(100_000).splitlines()


async def test_a_trickle_is_read_in_batches(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    reads, _, lines = await _drain([b"slot launch: one line\n"] * 20, every=0.01)
    assert lines == ["slot launch: one line"] * 20
    assert reads <= 20 * 0.01 / DRAIN_PAUSE + 2  # a line at a time would be 20 reads


async def test_a_flood_is_read_at_once(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    line = b"x" * 99 + b"\n"
    flood = line * (DRAIN_BATCH // len(line) + 1)
    _, lag, lines = await _drain([flood] * 5, every=0.01)
    assert lines[-1] == "x" * 99  # read to its end (the tail keeps the last lines)
    assert lag < DRAIN_PAUSE / 2  # read as it came: no pause after a read of DRAIN_BATCH bytes or more


async def test_a_serving_runners_output_is_kept_not_split_into_lines(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    server = LlamaServer(ModelSpec("m:latest", "/nonexistent/m.gguf"), RunnerOptions(), Placement(0), 0)
    server._loaded = True
    seen: list[str] = []
    server._on_line = seen.append  # type: ignore[method-assign]
    send, receive = trio.testing.memory_stream_one_way_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._drain, receive)
        await send.send_all(b"srv update: - prompt 1\nsrv upd")
        await send.send_all(b"ate: - prompt 2\r\nerror: out of memory\n")
        await send.aclose()
    assert seen == []  # no line handled one by one
    assert server.tail.text().splitlines() == ["srv update: - prompt 1", "srv update: - prompt 2", "error: out of memory"]
    assert server.tail.errors() == "error: out of memory"


def test_the_tail_keeps_the_last_bytes_in_whole_lines() -> None:
    tail = OutputTail(limit=100)
    for i in range(50):
        tail.feed(f"line {i:03d} of the log\n".encode())
    lines = tail.lines()
    assert lines[-1] == "line 049 of the log" and all(line.startswith("line ") and len(line) == 19 for line in lines)
    assert 4 <= len(lines) <= 10  # about the last 100 bytes (up to twice that before a trim)
    tail.feed(b"partial, no newline yet")
    assert tail.text(1) == "partial, no newline yet"
    assert OutputTail().text() == "" and OutputTail().errors() == ""
