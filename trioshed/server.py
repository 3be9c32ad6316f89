"""``serve()``: the root nursery holding the scheduler and hypercorn; signals; systemd notify.

The scheduler owns the runners and is started first (``nursery.start``); hypercorn serves the
Quart-Trio app (wrapped in the :class:`~trioshed.api.pipeline.drain.Drain`) until cancelled or a shutdown
is requested (SIGINT/SIGTERM). Shutdown drains: new requests get 503 + Retry-After, requests in
flight get up to ``TRIOSHED_SHUTDOWN_TIMEOUT`` (a second signal ends the wait), then queued ones
get 503 and the rest are cut (streams end with an error line); then hypercorn stops, and the
scheduler stops and reaps every runner. SIGHUP re-reads ``models.toml`` (:mod:`trioshed.reload`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from trioshed import systemd
from trioshed.access import is_loopback
from trioshed.api.app import create_app
from trioshed.api.pipeline.drain import Drain
from trioshed.api.pipeline.listener import ConnectionStats, hypercorn_config, serve_http
from trioshed.api.state import AppState
from trioshed.config import Settings
from trioshed.core import placement
from trioshed.core.adapter_memory import adapter_bytes, with_adapters
from trioshed.core.adapters import runner_model
from trioshed.core.estimate import estimate
from trioshed.core.model import MemoryEstimate, ModelSpec, RunnerOptions
from trioshed.core.projector import projector_memory
from trioshed.devices import DeviceSource, discover
from trioshed.devices.rpc import RemoteDevices, check_addresses
from trioshed.fleet import build_fleet
from trioshed.fleet.state import default_name
from trioshed.heap import collect_regularly, fix_mmap_threshold, settle, trim_when_quiet
from trioshed.logtail import LogTail
from trioshed.models.gguf_meta import read_metadata
from trioshed.models.stores import Stores
from trioshed.preload import preload_models
from trioshed.reload import reload_on_sighup
from trioshed.runner.binary import LlamaBinary, describe_build, find_llama_server
from trioshed.runner.command import LaunchConfig
from trioshed.runner.process import open_llama_server
from trioshed.runner.slots import WarmReturns
from trioshed.runner.slotstore import SlotStore
from trioshed.scheduler import Scheduler
from trioshed.scheduler.timeline import run_timeline
from trioshed.usage.keysync import KeySync
from trioshed.usage.team import build_recorder

log = logging.getLogger(__name__)


def estimate_model(spec: ModelSpec, options: RunnerOptions, max_tensor: int = 0) -> MemoryEstimate:
    """Read the GGUF header (cached) and estimate the runner that serves a request for ``spec``
    (an adapter-model's: the base with every adapter of its group,
    :func:`trioshed.core.adapters.runner_model`); adapters by their tensors, on the layers they
    adapt (:mod:`trioshed.core.adapter_memory`), a projector by its header (weights and compute
    buffer: :func:`trioshed.core.projector.projector_memory`).
    ``max_tensor``: the GPUs' largest tensor (``DeviceSource.max_tensor``; 0: no limit).

    Called for every request: cached by the files' identity (path, mtime, size) and the options.
    """
    spec = runner_model(spec, embedding=options.embedding)
    files = (spec.path, *spec.adapters, *((spec.projector,) if spec.projector else ()))
    stats = tuple((f, st.st_mtime_ns, st.st_size) for f in files for st in (os.stat(f),))
    return _estimate_cached(stats, len(spec.adapters), options, max_tensor)


@functools.lru_cache(maxsize=256)
def _estimate_cached(
    files: tuple[tuple[str, int, int], ...], n_adapters: int, options: RunnerOptions, max_tensor: int
) -> MemoryEstimate:
    meta = read_metadata(files[0][0])
    placed, unplaced = [], 0
    for path, _, size in files[1 : 1 + n_adapters]:
        try:
            tensors = read_metadata(path).tensors
        except (OSError, ValueError):
            unplaced += size  # unreadable: llama-server will say so when it loads it
            continue
        placed.append(adapter_bytes(((t.name, t.nbytes) for t in tensors), meta.block_count))
    projector = sum(_projector_bytes(path, size, options) for path, _, size in files[1 + n_adapters :])
    draft = read_metadata(options.draft) if options.draft else None
    est = estimate(meta, options, projector_bytes=projector, adapter_bytes=unplaced, draft=draft, max_tensor=max_tensor)
    return with_adapters(est, placed)


def _projector_bytes(path: str, size: int, options: RunnerOptions) -> int:
    try:
        return projector_memory(read_metadata(path), flash_attention=options.flash_attention)
    except (OSError, ValueError):
        return size  # unreadable: llama-server will say so when it loads it


@dataclass
class Server:
    """A running trioshed: what tests and the CLI may look at."""

    settings: Settings
    state: AppState
    urls: list[str]
    devices: DeviceSource
    drain: Drain
    connections: ConnectionStats

    @property
    def scheduler(self) -> Scheduler:
        return self.state.scheduler

    @property
    def base_url(self) -> str:
        return self.urls[0]


def build_warm_returns(settings: Settings) -> WarmReturns:
    """Saved slots (warm returns) in TRIOSHED_KV_CACHE_DIR; off when the budget is 0."""
    return WarmReturns(SlotStore(settings.kv_cache_dir, settings.kv_cache_budget), settings.kv_save_timeout)


def build_scheduler(
    settings: Settings, devices: DeviceSource, binary: LlamaBinary, record: list[tuple[str, str]] | None = None,
    warm: WarmReturns | None = None,
) -> Scheduler:
    launch = LaunchConfig(
        binary=binary.path,
        env=tuple({**binary.env, **dict(devices.runner_env)}.items()),
        load_timeout=settings.load_timeout,
        verbose=settings.runner_verbose,
        accounting_only=devices.accounting_only,
        warm=warm,
    )
    remote = None
    if settings.rpc_servers:
        remote = RemoteDevices(
            settings.rpc_servers, llama_server=binary.path, env=binary.env, interval=settings.rpc_probe_interval
        )
    return Scheduler(
        devices=devices,
        remote=remote,
        factory=partial(open_llama_server, config=launch),
        estimator=partial(estimate_model, max_tensor=devices.max_tensor),
        place=placement.place,
        max_queue=settings.max_queue,
        max_extra_wait=settings.max_extra_wait,
        max_loaded_models=settings.max_loaded_models,
        default_keep_alive=settings.keep_alive,
        gpu_overhead=settings.gpu_overhead,
        spread=settings.sched_spread,
        record=record,
    )


async def llama_build(binary: LlamaBinary) -> str:
    """The llama.cpp build ``binary`` is (``llama-server --version``; 40 ms), for the start-up log."""
    try:
        with trio.fail_after(30):
            done = await trio.run_process(
                [binary.path, "--version"], env=binary.env, capture_stdout=True, capture_stderr=True, check=False
            )
    except (OSError, trio.TooSlowError) as exc:
        return f"build unknown (--version failed: {exc})"
    return describe_build(binary, (done.stdout + done.stderr).decode(errors="replace"))


async def serve(
    settings: Settings,
    *,
    binary: LlamaBinary | None = None,
    handle_signals: bool = True,
    record: list[tuple[str, str]] | None = None,
    settle_heap: bool = False,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when ``handle_signals``); with ``settle_heap``
    (a process that serves until it exits), start-up's objects are frozen once listening and
    garbage is collected regularly (:mod:`trioshed.heap`)."""
    binary = binary or find_llama_server(settings.llama_server)
    fix_mmap_threshold()  # large temporary buffers mapped on their own: no holes left in the heap
    await check_addresses(settings.rpc_servers, allow_public=settings.rpc_allow_public)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request otherwise
    # --list-devices takes ~0.1-0.5 s (once per process: cached): off the event loop
    devices = await trio.to_thread.run_sync(
        partial(discover, settings.devices, binary=binary.path, env=binary.env, vulkan_software=settings.vulkan_software)
    )
    warm = build_warm_returns(settings)
    try:
        await warm.open()
    except OSError as exc:
        log.warning("warm returns off: cannot use TRIOSHED_KV_CACHE_DIR %s: %s", settings.kv_cache_dir, exc)
        warm = WarmReturns(SlotStore(settings.kv_cache_dir, 0), settings.kv_save_timeout)
    scheduler = build_scheduler(settings, devices, binary, record, warm=warm)
    store = Stores(settings.models, allow_symlinks=settings.allow_symlinks)
    log_tail = LogTail()  # the status page's log: the last lines, in memory
    state = AppState(settings=settings, store=store, scheduler=scheduler, warm=warm, log_tail=log_tail)
    state.usage = build_recorder(settings)  # SQLite, or the team's PostgreSQL (TRIOSHED_DATABASE)
    state.fleet = build_fleet(
        settings, settings.node_name or default_name(settings.port), scheduler.statistics, store, devices,
        lambda spec: estimate_model(spec, state.runner_options(spec, {}), devices.max_tensor).total,
    )  # fmt: skip
    quart_app = create_app(state)  # installs the gate's key rebuild, state.reload_keys
    assert state.reload_keys is not None
    state.key_sync = KeySync(state.usage, settings.keys_file, reload=state.reload_keys, stale_after=settings.keys_stale)
    fast = quart_app.config["TRIOSHED_FAST"]  # the generating routes (TRIOSHED_FAST_ROUTES) and blob uploads
    app = Drain(quart_app, idle_timeout=settings.stream_idle_timeout, fast=fast)  # type: ignore[arg-type]
    if state.fleet is not None:
        state.fleet.local.draining = lambda: app.draining  # a draining node is routed nothing new
    config = hypercorn_config(settings)
    connections = ConnectionStats(settings.max_connections)
    if not is_loopback(settings.host):
        # the Host check against DNS rebinding applies to loopback listeners only (trioshed.access)
        if settings.api_key or settings.keys_file:
            log.info("listening on %s: Host names are not checked; TRIOSHED_API_KEY guards every route", settings.host)
        else:
            log.warning(
                "listening on %s without TRIOSHED_API_KEY: anyone who can reach this address (and any web "
                "page re-pointing a name at it: Host names are not checked off loopback) can run and "
                "unload models; set TRIOSHED_API_KEY or bind to 127.0.0.1",
                settings.host,
            )
    log.info(
        "devices: %s (%s); llama-server: %s, %s; RPC servers: %s",
        ", ".join(f"{d.id} {d.total / 2**30:.1f} GiB" for d in devices.gpus) or "CPU only",
        devices.kind,
        await llama_build(binary),
        binary.path,
        ", ".join(s.address for s in settings.rpc_servers) or "none",
    )
    http_stopped = trio.Event()
    # The usage writer outlives every request: shielded from a cancellation of serve(), it is
    # stopped (and writes what is left) only once the nursery holding hypercorn has ended.
    usage_scope = trio.CancelScope(shield=True)
    async with trio.open_nursery() as outer:
        await outer.start(_run_in, usage_scope, state.usage.run)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(log_tail.run_installed)
                await nursery.start(state.writer.run)  # the store's writer: pulls, creates, pushes run there
                await nursery.start(state.key_sync.run)  # the store's keys in force before listening, then polled
                await nursery.start(scheduler.run)
                await nursery.start(app.watch)  # ends upstream reads that stall (TRIOSHED_STREAM_IDLE_TIMEOUT)
                await nursery.start(quart_app.config["TRIOSHED_METRICS"].run)  # counts ended requests, off their path
                if state.fleet is not None:
                    await nursery.start(state.fleet.run)
                nursery.start_soon(run_timeline, scheduler, state.timeline)  # the status page's last hour
                if links := state.store.links_out():
                    log.warning(
                        "not serving %d model file(s) that are symlinks out of the store: %s; name them in "
                        "models.toml, or set TRIOSHED_ALLOW_SYMLINKS=1 to follow such links",
                        len(links), ", ".join(str(p) for p in links),
                    )  # fmt: skip
                catalogue = state.store.catalogue()  # parsed now: its problems are logged at start-up
                if catalogue.entries or catalogue.problems:
                    log.info(
                        "models.toml: %d models, %d problems, %d to preload",
                        len(catalogue.entries), len(catalogue.problems), len(catalogue.preload),
                    )  # fmt: skip
                await preload_models(state)  # before listening: the first request finds them loaded
                if handle_signals:
                    nursery.start_soon(_receive_signals, app)
                    nursery.start_soon(reload_on_sighup, state)
                nursery.start_soon(_drain_on_request, app, scheduler, settings.shutdown_timeout, http_stopped)
                nursery.start_soon(trim_when_quiet, scheduler.wait_changed, partial(_idle, scheduler), lambda: scheduler.changed_at)
                async with trio.open_nursery() as http_nursery:
                    urls = await http_nursery.start(partial(serve_http, app, config, connections, shutdown_trigger=http_stopped.wait))
                    urls = [u.replace("0.0.0.0", "127.0.0.1") for u in urls]
                    log.info("trioshed listening on %s", ", ".join(urls))
                    if state.fleet is not None:
                        state.fleet.source.listening(urls[0])  # its place in the shared database, from now on
                    if settle_heap:
                        settle()
                        nursery.start_soon(collect_regularly)
                    systemd.notify("READY=1")
                    nursery.start_soon(systemd.run_notifier, partial(_status, scheduler, app))
                    task_status.started(Server(settings, state, urls, devices, app, connections))
                # hypercorn has finished its graceful shutdown: now stop and reap the runners
                systemd.notify("STOPPING=1")
                nursery.cancel_scope.cancel(reason="shutdown")
        finally:
            usage_scope.cancel(reason="every request has ended")
    log.info("trioshed stopped")


async def _run_in(
    scope: trio.CancelScope, run: Callable[..., Awaitable[None]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """``run(task_status=...)`` inside ``scope``."""
    with scope:
        await run(task_status=task_status)


async def _drain_on_request(drain: Drain, scheduler: Scheduler, grace: float, http_stopped: trio.Event) -> None:
    """Once a shutdown is requested: drain (see the module docstring), then stop hypercorn."""
    await drain.requested.wait()
    systemd.notify("STOPPING=1")
    drain.begin()
    log.info("draining %d request(s) in flight for up to %gs (TRIOSHED_SHUTDOWN_TIMEOUT)", drain.inflight, grace)
    with trio.move_on_after(grace):
        await drain.wait_idle()
    if drain.inflight:
        log.warning("shutdown: cutting %d request(s) still in flight", drain.inflight)
    scheduler.close_queue()
    await drain.cut()
    http_stopped.set()


def _idle(scheduler: Scheduler) -> bool:
    stats = scheduler.statistics()
    return stats.leased == 0 and stats.queued == 0


def _status(scheduler: Scheduler, drain: Drain) -> str:
    stats = scheduler.statistics()
    return systemd.status_line(stats.loaded, stats.loading, stats.queued, drain.inflight, drain.draining)


async def _receive_signals(drain: Drain) -> None:
    """SIGINT/SIGTERM: the first starts the drain, a second ends its wait."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            drain.request_shutdown()
