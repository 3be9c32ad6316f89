"""The drain's guards, in simulated time: at the end of a shutdown's grace, whatever a request
still runs is cancelled, on the fast path (which runs in scopes it takes from its guard) as on
Quart's, and a part of a request that starts after that is cancelled at once."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from trioshed.api.pipeline import drain


class _Stuck:
    """A request that waits on nothing the drain can end early (not an upstream wait)."""

    def __init__(self, fast: bool) -> None:
        self.fast = fast
        self.running: list[str] = []
        self.ended: list[str] = []

    def wants(self, scope: dict[str, Any]) -> bool:
        return scope["path"] == "/fast"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        try:
            if self.fast and self.wants(scope):
                guard = drain.current_guard()
                assert guard is not None
                with guard.new_scope():
                    self.running.append(path)
                    await trio.sleep_forever()
            else:
                self.running.append(path)
                await trio.sleep_forever()
        finally:
            self.ended.append(path)


async def _pump() -> dict[str, Any]:
    await trio.sleep_forever()
    raise AssertionError


async def _send(message: dict[str, Any]) -> None:
    pass


async def test_the_end_of_the_grace_cancels_what_is_left_on_both_paths(autojump_clock: trio.testing.MockClock) -> None:
    stuck = _Stuck(fast=True)
    d = drain.Drain(stuck, idle_timeout=30.0, fast=stuck)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        for path in ("/fast", "/other"):
            nursery.start_soon(d, {"type": "http", "path": path, "method": "POST"}, _pump, _send)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(stuck.running) == ["/fast", "/other"] and d.inflight == 2
        d.begin()
        started = trio.current_time()
        await d.cut(grace=2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() - started == 2.0
    assert sorted(stuck.ended) == ["/fast", "/other"] and d.inflight == 0


def test_a_part_that_starts_after_the_cancel_is_cancelled_at_once() -> None:
    guard = drain.RequestGuard(30.0)
    first = guard.new_scope()
    guard.cancel()
    assert first.cancel_called
    assert guard.new_scope().cancel_called  # e.g. Quart's answer after the fast path gave up
