"""Freed heap memory goes back to the system once the scheduler is quiet and idle, and once a
few seconds in a worker thread under a load that never goes quiet."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.lowlevel
import trio.testing
from trio_util import RepeatedEvent

from trioshed import heap


class Changes:
    """A scheduler's changes as the trimmer reads them: an event, and when it was last set."""

    def __init__(self) -> None:
        self.event = RepeatedEvent()
        self.at = 0.0

    def set(self) -> None:
        self.at = trio.current_time()
        self.event.set()

    def start(self, idle: Callable[[], bool], **kw: float) -> Callable[[], Awaitable[None]]:
        return lambda: heap.trim_when_quiet(self.event.wait, idle, lambda: self.at, **kw)


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    done: list[float] = []
    monkeypatch.setattr(heap, "trim", lambda: done.append(trio.current_time()) or True)
    return done


async def test_a_quiet_idle_server_trims_once_after_each_spell_of_activity(autojump_clock: trio.testing.MockClock, trims: list[float]) -> None:
    changes, idle = Changes(), [True]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(changes.start(lambda: idle[0]))
        await trio.sleep(10)
        assert trims == []  # nothing happened: nothing to give back
        for _ in range(20):  # a load: a change every 0.1 s
            changes.set()
            await trio.sleep(0.1)
        assert trims == []
        await trio.sleep(heap.QUIET + 0.01)
        assert len(trims) == 1 and trims[0] == pytest.approx(12.0 - 0.1 + heap.QUIET, abs=0.02)
        await trio.sleep(60)
        assert len(trims) == 1  # once per spell
        idle[0] = False  # a stream that runs for minutes changes nothing: not idle, no trim
        changes.set()
        await trio.sleep(60)
        assert len(trims) == 1
        nursery.cancel_scope.cancel()


async def test_a_spell_of_activity_wakes_the_trimmer_once_per_quiet_period_not_per_change(
    autojump_clock: trio.testing.MockClock, trims: list[float]
) -> None:
    changes, looks = Changes(), [0]

    def last_change() -> float:
        looks[0] += 1
        return changes.at

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: heap.trim_when_quiet(changes.event.wait, lambda: True, last_change))
        await trio.sleep(1)
        for _ in range(1000):  # ten seconds of a change every 10 ms
            changes.set()
            await trio.sleep(0.01)
        await trio.sleep(heap.QUIET + 0.01)
        nursery.cancel_scope.cancel()
    assert len(trims) == 1 and trims[0] == pytest.approx(11.0 - 0.01 + heap.QUIET, abs=0.02)
    assert looks[0] <= 3 * (10 / heap.QUIET + 2)  # a few looks per quiet period, not one per change (1,000)


async def _load(changes: Changes, seconds: float, *, hold_for_threads: bool = False) -> None:
    """A change every 0.1 s: never quiet. ``hold_for_threads``: while a worker thread runs, stay
    runnable so that the autojump clock does not move on (how long a thread takes is real time)."""
    limiter = trio.to_thread.current_default_thread_limiter()
    for _ in range(round(seconds / 0.1)):
        changes.set()
        await trio.sleep(0.1)
        while hold_for_threads and limiter.borrowed_tokens:
            await trio.lowlevel.checkpoint()


async def test_a_load_that_never_goes_quiet_trims_every_busy_period_in_a_worker_thread(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    done: list[tuple[float, bool]] = []
    loop = threading.get_ident()

    def fake_trim() -> bool:
        done.append((trio.from_thread.run_sync(trio.current_time), threading.get_ident() != loop))
        return True

    monkeypatch.setattr(heap, "trim", fake_trim)
    changes = Changes()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(changes.start(lambda: False))
        await trio.sleep(5)
        await _load(changes, 3.5 * heap.BUSY_EVERY, hold_for_threads=True)
        assert [round(t) for t, _ in done] == [round(heap.BUSY_EVERY * n) for n in (1, 2, 3)]
        assert all(in_worker for _, in_worker in done)
        await trio.sleep(600)  # the load ended: a busy server that is quiet trims no more
        assert len(done) == 3
        nursery.cancel_scope.cancel()


async def test_a_busy_trim_does_not_hold_the_event_loop(autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    began, release, saw_release = trio.Event(), threading.Event(), []

    def slow_trim() -> bool:  # a trim that lasts until the loop, still serving, says it may end
        trio.from_thread.run_sync(began.set)
        saw_release.append(release.wait(timeout=10))
        return True

    monkeypatch.setattr(heap, "trim", slow_trim)
    changes = Changes()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(changes.start(lambda: False, busy_every=1.0))
        nursery.start_soon(_load, changes, 30.0)
        await began.wait()
        ticks = 0
        for _ in range(5):  # the loop runs other tasks while the trim is under way
            await trio.sleep(0.1)
            ticks += 1
        release.set()
        nursery.cancel_scope.cancel()
    assert ticks == 5 and saw_release == [True]


def test_trim_gives_memory_back_with_glibc_and_does_nothing_elsewhere() -> None:
    assert heap.trim() is (platform.libc_ver()[0] == "glibc")


MMAP_PROBE = """
import ctypes, sys
from trioshed.heap import fix_mmap_threshold

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "pinned":
    assert fix_mmap_threshold()
libc.free(libc.malloc(8 << 20))  # a large temporary buffer, mapped then unmapped
block = libc.malloc(1 << 20)     # the next large one
print(libc.mallinfo2().hblkhd >= (1 << 20))
"""


@pytest.mark.parametrize(("how", "mapped"), [("pinned", "True"), ("default", "False")])
def test_a_large_buffer_after_a_larger_one_is_mapped_on_its_own_once_the_threshold_is_pinned(how: str, mapped: str) -> None:
    # glibc raises its mmap threshold to the size of a mapped block freed: the next large buffer
    # then comes from the heap (and leaves a hole there when freed). Pinned, it is mapped.
    done = subprocess.run([sys.executable, "-c", MMAP_PROBE, how], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == mapped


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_cyclic_garbage_is_collected_every_period_without_waiting_for_the_collectors_own_thresholds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    import gc
    import weakref

    was_enabled = gc.isenabled()
    gc.disable()  # only the regular collection may free it
    try:
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        del cycle
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heap.collect_regularly, 10.0)
            await trio.sleep(9.5)
            assert gone() is not None  # not yet: the period has not passed
            await trio.sleep(1.0)
            assert gone() is None
            nursery.cancel_scope.cancel()
    finally:
        if was_enabled:
            gc.enable()


def test_settle_frees_start_ups_garbage_and_freezes_the_rest_so_a_full_collection_walks_only_what_came_since() -> None:
    # in a child: freezing is for a process that serves until it exits, not for the test run
    script = """
import gc, weakref
from trioshed import heap

class Cycle:
    def __init__(self):
        self.me = self

kept = [Cycle() for _ in range(1000)]  # start-up's objects, alive for good
before = Cycle()
gone_before = weakref.ref(before)
del before
gc.disable()
heap.settle()
assert gone_before() is None, "start-up's garbage freed"
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
assert len(gc.get_objects(2)) < 100, len(gc.get_objects(2))
after = Cycle()
gone_after = weakref.ref(after)
del after
gc.collect()
assert gone_after() is None, "garbage made since is still collected"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
