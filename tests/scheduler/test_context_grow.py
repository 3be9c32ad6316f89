"""Growing a runner's context on demand (simulated time, in-process fake runners).

A request whose automatic context is a larger bucket than its model's runner reloads the model
at that bucket, as any swap: requests that fit the runner now keep being served while the swap
is held (TRIOSHED_MAX_EXTRA_WAIT), the reload waits for running requests (never shrinking or
growing under them), and afterwards smaller requests are served by the larger runner.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.core.model import RunnerOptions

SMALL, LARGE = RunnerOptions(num_ctx=4096, num_parallel=2), RunnerOptions(num_ctx=16384, num_parallel=2)


async def test_a_longer_request_grows_the_context_after_the_running_one(autojump_clock: trio.testing.MockClock) -> None:
    async with running({"a": 1}, max_extra_wait=5.0) as h:
        release = trio.Event()
        await h.hold("a", release, options=SMALL)
        order: list[str] = []

        async def ask(name: str, options: RunnerOptions) -> None:
            async with h.sched.acquire(spec("a"), options) as lease:
                order.append(f"{name}@{lease.options.num_ctx}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "long", LARGE)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "short", SMALL)  # fits the runner now: not held behind the swap
            await trio.testing.wait_all_tasks_blocked()
            assert h.factory.started == 1  # nothing reloads under the running request
            await trio.sleep(1)
            release.set()
        assert order[-1] == "long@16384"
        assert order[:-1] == ["short@4096"]
        assert h.factory.started == 2
        after = await h.once("a", options=SMALL)  # served by the larger runner: no shrink
        assert after.options.num_ctx == 16384 and h.factory.started == 2
