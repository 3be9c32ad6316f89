"""Freed heap memory goes back to the system once the scheduler is quiet and idle, never during a load."""

from __future__ import annotations

import platform

import pytest
import trio
import trio.testing
from trio_util import RepeatedEvent

from trioshed import heap


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    done: list[float] = []
    monkeypatch.setattr(heap, "trim", lambda: done.append(trio.current_time()) or True)
    return done


async def test_a_quiet_idle_server_trims_once_after_each_spell_of_activity(autojump_clock: trio.testing.MockClock, trims: list[float]) -> None:
    changes, idle = RepeatedEvent(), [True]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: heap.trim_when_quiet(changes.wait, lambda: idle[0]))
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


def test_trim_gives_memory_back_with_glibc_and_does_nothing_elsewhere() -> None:
    assert heap.trim() is (platform.libc_ver()[0] == "glibc")
