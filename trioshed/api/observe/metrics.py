"""Prometheus metrics at /metrics, through ``prometheus_client`` with one registry per app.

Two sources, one registry (per app, so that several servers in one process never share or
clash):

- at scrape time, :class:`SchedulerCollector` reads the scheduler's ``statistics()`` snapshot
  (queue, leases, runners by state, memory per device, the scheduler's own running totals),
  :class:`StoreCollector` the usage store's (whether it is reachable, rows waiting and dropped),
  and :class:`~trioshed.api.observe.gateway.GatewayCollector` the readings of the Gateway API
  Inference Extension's model-server protocol (the route first reads the runners' slots);
- as things happen, :class:`Metrics` counts and times: loads, evictions, unloads and crashes
  from the scheduler's event history (``Scheduler.events``, read at each scrape from where the
  last one stopped), and every finished request from the HTTP edge (:mod:`trioshed.api.observe.request_log`).

The names below are part of the product (docs/service.md lists them); keep them stable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString
from quart import Blueprint, Response, current_app

from trioshed.api.observe.gateway import GatewayCollector
from trioshed.keys import current_key
from trioshed.runner.slots import WarmReturns
from trioshed.scheduler import Scheduler, SchedulerStatistics
from trioshed.scheduler.events import SchedulerEvent
from trioshed.trace import RequestTrace
from trioshed.usage.recorder import UsageRecorder

bp = Blueprint("metrics", __name__)

# A ``*_created`` timestamp series beside every counter and histogram is noise for scrapers that
# compute rates; this is process-wide in prometheus_client and trioshed owns its process.
disable_created_metrics()

# The scheduler's running totals in statistics(), exposed as counters ``trioshed_<field>_total``.
# A new int field in SchedulerStatistics is one line here (a test fails until it is listed).
SNAPSHOT_COUNTERS: dict[str, str] = {
    "loads": "Runner loads started.",
    "unloads": "Runners unloaded (keep-alive expiry, eviction, unload request).",
    "crashes": "Runners whose llama-server exited unexpectedly while serving.",
    "load_failures": "Runner loads that failed (the model then cools down before a retry).",
    "rejected": "Requests refused because the queue was full (TRIOSHED_MAX_QUEUE).",
    "room_waits": "Requests that had to wait for memory (counted once each).",
    "passes": "Planning passes run.",
}
# The snapshot's int fields read as gauges by SchedulerCollector, not as counters.
SNAPSHOT_GAUGES = frozenset({"queued", "leased", "loaded", "loading", "unloading"})

# Reasons as the scheduler words them (prefixes) → a fixed label value.
_REASONS = (
    ("make room", "make_room"),
    ("reload", "options_changed"),
    ("unload requested", "unload_requested"),
    ("health check", "health_check"),
    ("keep_alive 0", "keep_alive_0"),
    ("keep_alive expired", "keep_alive_expired"),
)
# The 503s a client can get, by the error's class name.
CAUSES = {
    "QueueFull": "queue_full",
    "LoadCooldown": "cooldown",
    "ShuttingDown": "shutting_down",
    "RemoteUnavailable": "rpc_server_down",
    "EventStreamsBusy": "event_streams_busy",
    "OutOfFiles": "out_of_files",
}

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
#: Ended requests are counted into the metrics this long after the first of them ends (a scrape
#: counts them at once), by the metrics' own task (:meth:`Metrics.run`): off the requests' path.
FINISHED_DELAY = 0.25
#: At most this many wait to be counted (more are counted at once).
FINISHED_MAX = 4096
_SECONDS_LOAD = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SECONDS_WAIT = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_SECONDS_REQUEST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def reason_label(reason: str) -> str:
    """The label value for a load/unload reason as the scheduler words it."""
    for prefix, label in _REASONS:
        if reason.startswith(prefix):
            return label
    return "other"


class SchedulerCollector:
    """Reads ``statistics()`` (and the devices' memory) at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        stats = self._scheduler.statistics()
        yield _gauge("trioshed_queued_requests", "Requests waiting for a runner.", stats.queued)
        yield _gauge("trioshed_leases", "Requests holding a runner slot now.", stats.leased)
        yield _gauge("trioshed_tasks", "Trio tasks alive in this process (one that only grows is a leak).", trio_tasks())
        runners = GaugeMetricFamily("trioshed_runners", "Runners by state.", labels=["state"])
        for state, value in (("ready", stats.loaded), ("loading", stats.loading), ("unloading", stats.unloading)):
            runners.add_metric([state], value)
        yield runners
        for name, doc in SNAPSHOT_COUNTERS.items():
            yield CounterMetricFamily(f"trioshed_{name}", doc, value=getattr(stats, name))

        size = GaugeMetricFamily("trioshed_runner_bytes", "Memory a runner takes (kind: total or vram).", labels=["model", "kind"])
        leases = GaugeMetricFamily("trioshed_runner_leases", "Requests holding a slot on the model's runners.", labels=["model"])
        by_model: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in stats.runners:
            m = by_model[r.model]
            m[0] += r.size
            m[1] += r.size_vram
            m[2] += r.leases
        for model, (total, vram, held) in by_model.items():
            size.add_metric([model, "total"], total)
            size.add_metric([model, "vram"], vram)
            leases.add_metric([model], held)
        yield size
        yield leases
        yield from _speculation(stats)
        yield self._device_memory(stats)
        if stats.tenants:  # per API key name
            waiting = GaugeMetricFamily("trioshed_key_queued_requests", "Requests waiting for a runner, by API key name.", labels=["key"])
            holding = GaugeMetricFamily("trioshed_key_leases", "Requests holding a runner slot, by API key name.", labels=["key"])
            for t in stats.tenants:
                waiting.add_metric([t.key], t.queued)
                holding.add_metric([t.key], t.leased)
            yield waiting
            yield holding
        if stats.remote:  # TRIOSHED_RPC_SERVERS: one series per server
            up = GaugeMetricFamily("trioshed_rpc_server_up", "Whether an RPC server answers its probe (1) or not (0).", labels=["endpoint"])
            rpc = GaugeMetricFamily("trioshed_rpc_server_bytes", "An RPC server's memory (kind: total, used by trioshed's runners).", labels=["endpoint", "kind"])
            for server in stats.remote:
                up.add_metric([server.address], int(server.up))
                rpc.add_metric([server.address, "total"], server.total)
                rpc.add_metric([server.address, "used"], server.used)
            yield up
            yield rpc

    def _device_memory(self, stats: SchedulerStatistics) -> Metric:
        family = GaugeMetricFamily(
            "trioshed_device_memory_bytes",
            "Memory per device (cpu = system memory); kind: total, free (as the device reports "
            "it; NVIDIA GPUs and system memory only), used (what trioshed's runners take by its accounting).",
            labels=["device", "kind"],
        )
        used: dict[str, int] = defaultdict(int)
        for r in stats.runners:
            for device_id, nbytes in r.usage:
                used[device_id] += nbytes
        source = self._scheduler.devices
        for device in (*source.poll(), source.system()):
            family.add_metric([device.id, "total"], device.total)
            if source.kind == "nvml" or device.id == "cpu":
                family.add_metric([device.id, "free"], device.free)
            family.add_metric([device.id, "used"], used.pop(device.id, 0))
        for device_id, nbytes in used.items():  # accounted somewhere no longer listed
            family.add_metric([device_id, "used"], nbytes)
        return family


def _speculation(stats: SchedulerStatistics) -> Iterator[Metric]:
    """Speculative decoding's drafted and accepted tokens per model, over its loaded runners
    (a runner's counts start at its load: an unload is a counter reset)."""
    drafted = CounterMetricFamily(
        "trioshed_speculative_drafted_tokens", "Tokens drafted by speculative decoding (n-gram or draft model), by model.", labels=["model"]
    )
    accepted = CounterMetricFamily(
        "trioshed_speculative_accepted_tokens", "Drafted tokens the model accepted, by model.", labels=["model"]
    )
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in stats.runners:
        if r.options.draft or r.options.speculation != "off":
            totals[r.model][0] += r.drafted
            totals[r.model][1] += r.accepted
    for model, (d, a) in totals.items():
        drafted.add_metric([model], d)
        accepted.add_metric([model], a)
    yield drafted
    yield accepted


def trio_tasks() -> int:
    """How many Trio tasks are alive (0 outside Trio): every nursery walked from the root."""
    try:
        tasks = [trio.lowlevel.current_root_task()]
    except RuntimeError:
        return 0
    count = 0
    while tasks:
        task = tasks.pop()
        if task is None:
            continue
        count += 1
        for nursery in task.child_nurseries:
            tasks.extend(nursery.child_tasks)
    return count


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


#: Warm returns' running totals (``WarmReturns.statistics()``) → ``trioshed_kv_<field>_total``.
WARM_COUNTERS: dict[str, str] = {
    "saves": "Slots saved to disk before their runner stopped.",
    "save_failures": "Slot saves that llama-server or the disk refused.",
    "saves_skipped": "Slot saves skipped: over TRIOSHED_KV_CACHE_BUDGET, cut by TRIOSHED_KV_SAVE_TIMEOUT, or holding image or audio tokens.",
    "restores": "Saved slots restored into a runner before a request.",
    "restore_failures": "Restores that failed (the request then computed its prompt).",
    "hits": "Requests on a fresh runner whose prompt continued a saved slot.",
    "misses": "Requests on a fresh runner with saved slots of its model, none matching.",
    "save_seconds": "Time spent saving slots (llama-server's save and the commit).",
    "restore_seconds": "Time spent restoring slots (check and llama-server's restore).",
}


class WarmCollector:
    """Reads warm returns' ``statistics()`` at scrape time."""

    def __init__(self, warm: WarmReturns) -> None:
        self._warm = warm

    def collect(self) -> Iterator[Metric]:
        stats = self._warm.statistics()
        for name, doc in WARM_COUNTERS.items():
            yield CounterMetricFamily(f"trioshed_kv_{name}", doc, value=getattr(stats, name))
        yield _gauge("trioshed_kv_bytes", "Bytes of saved slots on disk (TRIOSHED_KV_CACHE_DIR).", stats.bytes_on_disk)
        yield _gauge("trioshed_kv_files", "Saved slot files on disk.", stats.files)


class StoreCollector:
    """Reads the usage store's ``statistics()`` at scrape time (nothing without a store)."""

    def __init__(self, usage: UsageRecorder) -> None:
        self._usage = usage

    def collect(self) -> Iterator[Metric]:
        store = self._usage.statistics()
        if store is None:
            return
        up = GaugeMetricFamily("trioshed_database_up", "Whether this node's last use of the usage store worked (1) or not (0), by kind (sqlite, postgresql).", labels=["kind"])
        up.add_metric([store.kind], float(store.reachable))
        yield up
        yield _gauge("trioshed_usage_rows_pending", "Usage rows waiting in memory to be written to the store.", store.pending)
        yield CounterMetricFamily("trioshed_usage_rows_dropped", "Usage rows dropped: more were waiting than the bound while the store could not be written.", value=store.dropped)
        yield CounterMetricFamily("trioshed_usage_rows_written", "Usage rows written to the store by this node.", value=store.written)


class Metrics:
    """The app's registry: the scheduler's snapshot plus what is counted as it happens."""

    def __init__(self, scheduler: Scheduler, *, warm: WarmReturns | None = None, usage: UsageRecorder | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SchedulerCollector(scheduler))  # type: ignore[arg-type]
        self.gateway = GatewayCollector(scheduler)
        self.registry.register(self.gateway)  # type: ignore[arg-type]
        if warm is not None and warm.enabled:
            self.registry.register(WarmCollector(warm))  # type: ignore[arg-type]
        if usage is not None:
            self.registry.register(StoreCollector(usage))  # type: ignore[arg-type]
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, fds
        r = self.registry
        self.model_loads = Counter("trioshed_model_loads", "Runner loads started, by model.", ["model"], registry=r)
        # Per model: summaries (count and sum: 2 lines a model); the distributions: histograms
        # without the model label (a histogram per model was 15 lines a model, and most of a
        # scrape's cost with hundreds of models).
        self.load_duration = Summary(
            "trioshed_load_duration_seconds", "Time from starting llama-server to ready, by model.", ["model"], registry=r,
        )  # fmt: skip
        self.load_latency = Histogram(
            "trioshed_load_latency_seconds", "Time from starting llama-server to ready, all models.",
            buckets=_SECONDS_LOAD, registry=r,
        )  # fmt: skip
        self.load_failures = Counter("trioshed_model_load_failures", "Failed loads, by model.", ["model"], registry=r)
        self.evictions = Counter(
            "trioshed_evictions", "Runners chosen to be unloaded early (reason: make_room, options_changed, health_check).",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.unloads = Counter(
            "trioshed_model_unloads",
            "Runners unloaded, by model and reason (keep_alive_expired, keep_alive_0, make_room, "
            "options_changed, unload_requested, health_check).",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.crashes = Counter("trioshed_model_crashes", "llama-server exits while serving, by model.", ["model"], registry=r)
        self.requests = Counter(
            "trioshed_http_requests", "HTTP requests answered, by route, method and status (0: the client left first).",
            ["route", "method", "status"], registry=r,
        )  # fmt: skip
        self.request_duration = Summary(
            "trioshed_request_duration_seconds", "HTTP request time to the end of the response body, by model and route.",
            ["model", "route"], registry=r,
        )  # fmt: skip
        self.queue_wait = Summary(
            "trioshed_queue_wait_seconds", "Time from arrival at the scheduler to a runner slot (loads included), by model and route.",
            ["model", "route"], registry=r,
        )  # fmt: skip
        self.request_latency = Histogram(
            "trioshed_request_latency_seconds", "HTTP request time to the end of the response body, by route (all models).",
            ["route"], buckets=_SECONDS_REQUEST, registry=r,
        )  # fmt: skip
        self.queue_latency = Histogram(
            "trioshed_queue_latency_seconds", "Time from arrival at the scheduler to a runner slot (loads included), by route (all models).",
            ["route"], buckets=_SECONDS_WAIT, registry=r,
        )  # fmt: skip
        self.unavailable = Counter(
            "trioshed_unavailable", "503 answers by cause (queue_full, cooldown, shutting_down, rpc_server_down, event_streams_busy).", ["cause"], registry=r,
        )  # fmt: skip
        for cause in CAUSES.values():
            self.unavailable.labels(cause)  # present at 0 from the start
        # Per API key, by its name (only when keys are configured; never the key itself)
        self.key_requests = Counter(
            "trioshed_key_requests", "HTTP requests answered, by API key name and status (429: a key's limit).",
            ["key", "status"], registry=r,
        )  # fmt: skip
        self.key_queue_wait = Histogram(
            "trioshed_key_queue_wait_seconds", "Time from arrival at the scheduler to a runner slot, by API key name.",
            ["key"], buckets=_SECONDS_WAIT, registry=r,
        )  # fmt: skip
        self._children: dict[tuple[str, str, int, str], tuple[Any, Any, Any, Any, Any]] = {}
        self._finished: list[tuple[str, str, int, str, float | None, str, str, float]] = []
        self._pending = trio.Event()  # set when the first of a batch ended
        self._events = scheduler.events
        self._seen = self._events.last_seq  # counted from here on

    def _count_events(self) -> None:
        """Count the scheduler's events since the last scrape (at most its history's length)."""
        for event in self._events.after(self._seen):
            self._count(event)
        self._seen = self._events.last_seq

    def _count(self, e: SchedulerEvent) -> None:
        event, model, reason = e.kind, e.model, e.reason
        if event == "load":
            self.model_loads.labels(model).inc()
        elif event == "ready":
            self.load_duration.labels(model).observe(e.seconds)
            self.load_latency.observe(e.seconds)
        elif event == "evict":
            self.evictions.labels(model, reason_label(reason)).inc()
        elif event == "unloaded":
            self.unloads.labels(model, reason_label(reason)).inc()
        elif event == "crashed":
            self.crashes.labels(model).inc()
        elif event == "load failed":
            self.load_failures.labels(model).inc()

    def request_finished(self, trace: RequestTrace, duration: float) -> None:
        """Note a request that ended, to be counted by :meth:`run` (or the next scrape): five
        metrics' locks and buckets were a fifth of what a request's end cost on its own path."""
        finished = self._finished
        finished.append((trace.route, trace.method, trace.status, trace.model, trace.queue_wait, trace.error, trace.key, duration))
        if len(finished) == 1:
            self._pending.set()
        elif len(finished) >= FINISHED_MAX:
            self._count_finished()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: count the requests that ended, :data:`FINISHED_DELAY` after the first
        of each batch ended (one wake-up per batch, none while nothing ends)."""
        task_status.started()
        while True:
            await self._pending.wait()
            self._pending = trio.Event()
            await trio.sleep(FINISHED_DELAY)
            self._count_finished()

    def _count_finished(self) -> None:
        finished, self._finished = self._finished, []
        for route, method, status, model, queue_wait, error, api_key, duration in finished:
            method = method if method in _METHODS else "other"  # clients choose it: keep labels few
            key = (route, method, status, model)
            children = self._children.get(key)
            if children is None:  # labels() costs a few microseconds: once per label set, not per request
                route = route or "unmatched"
                children = self._children[key] = (
                    self.requests.labels(route, method, str(status)),
                    self.request_duration.labels(model, route),
                    self.queue_wait.labels(model, route),
                    self.request_latency.labels(route),
                    self.queue_latency.labels(route),
                )
            children[0].inc()
            children[1].observe(duration)
            children[3].observe(duration)
            if queue_wait is not None:
                children[2].observe(queue_wait)
                children[4].observe(queue_wait)
            if status == 503:
                self.unavailable.labels(error or "other").inc()
            if api_key:
                self.key_requests.labels(api_key, str(status)).inc()
                if queue_wait is not None:
                    self.key_queue_wait.labels(api_key).observe(queue_wait)

    def render(self, *, keys: bool = True) -> bytes:
        """The metrics as text; ``keys=False``: without the series labelled by API key name
        (``/metrics`` read without an admin key, where TRIOSHED_METRICS_PUBLIC allows it)."""
        self._count_events()
        self._count_finished()
        return render_text(self.registry, skip=() if keys else (KEY_SERIES,))


#: The families labelled by API key name: an admin's to read.
KEY_SERIES = "trioshed_key_"


def render_text(registry: CollectorRegistry, skip: tuple[str, ...] = ()) -> bytes:
    """What ``prometheus_client.generate_latest`` writes (text format 0.0.4), byte for byte, for a
    registry whose metric and label names are plain Prometheus names (trioshed's are), at under
    half its cost: its per-sample name validation and escaping were most of a scrape's time with
    hundreds of models (3,753 lines for 200 runners took ~100 ms)."""
    out: list[str] = []
    for metric in registry.collect():
        name, kind = metric.name, metric.type
        if skip and name.startswith(skip):
            continue
        exposed = name
        if kind == "counter":
            exposed = name + "_total"
        elif kind == "info":
            exposed, kind = name + "_info", "gauge"
        elif kind == "stateset":
            kind = "gauge"
        elif kind == "gaugehistogram":
            kind = "histogram"
        elif kind == "unknown":
            kind = "untyped"
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {exposed} {doc}\n# TYPE {exposed} {kind}\n")
        special = {name + suffix: suffix for suffix in ("_created", "_gsum", "_gcount")}
        held: dict[str, list[str]] = {}
        for sample in metric.samples:
            line = _sample_line(sample)
            suffix = special.get(sample.name)
            if suffix is None:
                out.append(line)
            else:  # OpenMetrics-only samples: each suffix a gauge of its own after the metric
                held.setdefault(suffix, []).append(line)
        for suffix, lines in sorted(held.items()):
            out.append(f"# HELP {name}{suffix} {doc}\n# TYPE {name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode()


def _sample_line(sample: Any) -> str:
    labels = sample.labels
    text = f"{sample.name} {floatToGoString(sample.value)}" if not labels else (
        sample.name + "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items())) + "} "
        + floatToGoString(sample.value)
    )  # fmt: skip
    if sample.timestamp is not None:
        text += f" {int(float(sample.timestamp) * 1000):d}"
    return text + "\n"


def _label_value(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return v


@bp.get("/metrics")
async def metrics() -> Response:
    metrics: Metrics = current_app.config["TRIOSHED_METRICS"]
    await metrics.gateway.refresh()  # the runners' slots, for the KV-cache utilization
    keys = current_key.get().admin  # read without an admin key (a public /metrics): no key names
    return Response(metrics.render(keys=keys), content_type=CONTENT_TYPE_PLAIN_0_0_4)
