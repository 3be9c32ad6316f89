"""The sampler behind the status page's pictures: once a second, what the scheduler holds.

A task owned by ``serve()``. It records a :class:`~trioshed.scheduler.events.Sample` each wall
second while a runner is loaded or a request waits, and one idle sample when that ends; while
idle it sleeps until the scheduler changes (no wake-ups on an idle server).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from trioshed.core.model import MiB
from trioshed.core.sched import CPU_ID
from trioshed.scheduler.events import Timeline
from trioshed.scheduler.scheduler import Scheduler
from trioshed.scheduler.stats import SchedulerStatistics

PROMPT_CACHE = " · prompt cache"  # the label of a runner's prompt-cache reservation


def sample_of(stats: SchedulerStatistics) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
    """Requests waiting per model, and each runner's bytes per device (its prompt-cache
    reservation in system memory apart, as ``/api/ps`` shows it apart)."""
    waiting: dict[str, int] = {}
    for q in stats.queue:
        waiting[q.model] = waiting.get(q.model, 0) + q.waiting
    memory: dict[tuple[str, str], int] = {}
    for r in stats.runners:
        cache = max(0, r.options.cache_ram_mib) * MiB
        for device, nbytes in r.usage:
            parts = [(r.model, nbytes)]
            if device == CPU_ID and cache:
                parts = [(r.model, max(0, nbytes - cache)), (r.model + PROMPT_CACHE, min(cache, nbytes))]
            for label, part in parts:
                if part > 0:
                    memory[device, label] = memory.get((device, label), 0) + part
    return waiting, [(device, label, n) for (device, label), n in memory.items()]


async def run_timeline(
    scheduler: Scheduler,
    timeline: Timeline,
    *,
    clock: Callable[[], float] = time.time,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample ``scheduler`` into ``timeline`` until cancelled.

    Cancellation: at any await; nothing to clean up.
    """
    task_status.started()
    while True:
        stats = scheduler.statistics()
        waiting, memory = sample_of(stats)
        now = clock()
        timeline.record(int(now), waiting, memory)
        if stats.runners or stats.queue:
            await trio.sleep(1.0 - now % 1.0 + 0.001)  # the next wall second
        else:
            await scheduler.wait_changed()
