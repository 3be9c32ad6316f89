"""The model-server protocol of Kubernetes' Gateway API Inference Extension, on ``/metrics``.

An endpoint picker (llm-d's, the extension's reference) scrapes each pod of an ``InferencePool``
and routes by four readings; trioshed gives them for the whole pod, one series each:

- :data:`QUEUED`: requests waiting for a runner (the scheduler's queue: for a slot, for a load,
  for memory);
- :data:`RUNNING`: requests holding a runner slot (being answered);
- :data:`KV_USAGE`: the KV-cache utilization, 0 to 1: the cells that the running requests hold
  (each running slot's prompt plus the tokens it generated so far, from each ready runner's
  ``GET /slots``: :mod:`trioshed.runner.occupancy`) over the cells of every ready runner
  (``--ctx-size``: the context per slot times the slots); 0 with no runner ready;
- :data:`ADAPTERS`: the LoRA adapter info, whose labels the picker parses: ``running_lora_adapters``
  (the models a ready runner serves now without a load, comma-separated: a plain model's
  runner its model, an adapter group's runner every warm model of its group), ``waiting_lora_adapters``
  (models that requests wait for and that no ready runner serves: loading, a group growing, or
  waiting for room) and ``max_lora``: the adapter sets the pod serves in one decode step. A
  runner runs one adapter set per step (llama-server batches only requests of one set; a group's
  members take turns), so that is one per runner it holds at once:
  ``TRIOSHED_MAX_LOADED_MODELS``, 3 per GPU when automatic. Every model is listed as
  ``/v1/models`` names it (no ``:latest``): the picker's adapter affinity then sends a request
  to the pod where its model is warm, an adapter-model to the pod whose group runner holds it.
  The value is the time of the last reading of the slots (the picker takes the newest series).

The names carry trioshed's own prefix; the picker reads them through the ``engineConfigs`` entry
shipped in ``packaging/kubernetes/`` (a test reads that file, so the two cannot drift).

The slots are read once per scrape (:meth:`GatewayCollector.refresh`, awaited by the route before
it renders), every ready runner at once, each bounded by :data:`READ_TIMEOUT`; scrapes that
arrive while a reading runs share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import trio
from prometheus_client.core import GaugeMetricFamily, Metric

from trioshed.runner.occupancy import SlotOccupancy, read_occupancy
from trioshed.scheduler import Scheduler
from trioshed.scheduler.stats import RunnerStats, SchedulerStatistics

__all__ = ["ADAPTERS", "KV_USAGE", "QUEUED", "RUNNING", "GatewayCollector", "adapters", "kv_usage"]

QUEUED = "trioshed:num_requests_waiting"
RUNNING = "trioshed:num_requests_running"
KV_USAGE = "trioshed:kv_cache_usage_perc"
ADAPTERS = "trioshed:lora_requests_info"
#: How long a scrape waits for one runner's slots (a busy llama-server answers between batches).
READ_TIMEOUT = 1.0

_READY = "ready"
_LOADING = "loading"


def kv_usage(runners: Iterable[RunnerStats], occupancy: Mapping[int, SlotOccupancy]) -> float:
    """The cells the running requests hold over the cells of the ready runners (0 with none).

    A runner whose slots could not be read counts as holding none of its cells."""
    capacity = used = 0
    for r in runners:
        if r.state != _READY:
            continue
        cells = r.options.kv_cells
        capacity += cells
        held = occupancy.get(r.id)
        if held is not None:
            used += min(held.tokens, cells)
    return used / capacity if capacity else 0.0


def adapters(stats: SchedulerStatistics) -> tuple[list[str], list[str]]:
    """The models with a ready runner, and those requests wait for that have none (names as
    ``/v1/models`` gives them)."""
    running = {_short(name) for r in stats.runners if r.state == _READY for name in _serves(r)}
    waiting = {_short(q.model) for q in stats.queue if q.waiting} | {_short(r.model) for r in stats.runners if r.state == _LOADING}
    return sorted(running), sorted(waiting - running)


def _serves(r: RunnerStats) -> list[str]:
    """The models a runner serves now: its model, and an adapter group's warm members."""
    return [r.model, *(m.name for m in r.members)] if r.adapters else [r.model]


def _short(name: str) -> str:
    return name.removesuffix(":latest")


class GatewayCollector:
    """The four readings, collected at scrape time (after :meth:`refresh`)."""

    def __init__(self, scheduler: Scheduler, *, clock: Callable[[], float] = time.time) -> None:
        self._scheduler = scheduler
        self._clock = clock
        self._occupancy: dict[int, SlotOccupancy] = {}
        self._read_at = clock()  # when the slots were last read (the adapter info's value)
        self._reading: trio.Event | None = None

    async def refresh(self) -> None:
        """Read every ready runner's slots.

        Cancellation: a cancelled reading keeps the last complete one; a scrape waiting on
        another's reading returns when that one ends, however it ends."""
        if self._reading is not None:
            await self._reading.wait()
            return
        done = self._reading = trio.Event()
        found: dict[int, SlotOccupancy] = {}

        async def read(r: RunnerStats) -> None:
            assert r.upstream is not None
            with trio.move_on_after(READ_TIMEOUT):
                held = await read_occupancy(r.upstream)
                if held is not None:
                    found[r.id] = held

        try:
            async with trio.open_nursery() as nursery:
                for r in self._scheduler.statistics().runners:
                    if r.state == _READY and r.upstream is not None:
                        nursery.start_soon(read, r)
            self._occupancy = found
            self._read_at = self._clock()
        finally:
            self._reading = None
            done.set()

    def collect(self) -> Iterator[Metric]:
        stats = self._scheduler.statistics()
        yield GaugeMetricFamily(QUEUED, "Requests waiting for a runner (model-server protocol: TotalQueuedRequests).", value=stats.queued)
        yield GaugeMetricFamily(RUNNING, "Requests holding a runner slot (model-server protocol: TotalRunningRequests).", value=stats.leased)
        yield GaugeMetricFamily(
            KV_USAGE,
            "KV-cache utilization, 0 to 1: cells held by running requests over the ready runners' cells (KVCacheUtilization).",
            value=kv_usage(stats.runners, self._occupancy),
        )
        running, waiting = adapters(stats)
        info = GaugeMetricFamily(
            ADAPTERS,
            "Models with a ready runner and models waited for, as the picker's LoRA affinity reads them; the value is the time the slots were last read.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(self._scheduler.max_loaded), ",".join(running), ",".join(waiting)], self._read_at)
        yield info
