"""``serve()``: the root nursery holding the scheduler and hypercorn; signals; systemd notify.

The scheduler owns the runners and is started first (``nursery.start``); hypercorn serves the
Quart-Trio app until SIGINT/SIGTERM or cancellation; on the way out hypercorn stops accepting,
then the scheduler stops and reaps every runner.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
from dataclasses import dataclass
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from trioshed.api.app import create_app
from trioshed.api.state import AppState
from trioshed.config import Settings
from trioshed.core import placement
from trioshed.core.estimate import estimate
from trioshed.core.model import MemoryEstimate, ModelSpec, RunnerOptions
from trioshed.devices import DeviceSource, discover
from trioshed.devices.rpc import RemoteDevices, check_addresses
from trioshed.models.gguf_meta import read_metadata
from trioshed.models.stores import Stores
from trioshed.preload import preload_models
from trioshed.runner.binary import LlamaBinary, describe_build, find_llama_server
from trioshed.runner.command import LaunchConfig
from trioshed.runner.process import open_llama_server
from trioshed.scheduler import Scheduler

log = logging.getLogger(__name__)


def estimate_model(spec: ModelSpec, options: RunnerOptions) -> MemoryEstimate:
    """Read the GGUF header (cached) and estimate; adapters and projector by file size.

    Called for every request: cached by the files' identity (path, mtime, size) and the options.
    """
    files = (spec.path, *spec.adapters, *((spec.projector,) if spec.projector else ()))
    stats = tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files)
    return _estimate_cached(stats, len(spec.adapters), options)


@functools.lru_cache(maxsize=256)
def _estimate_cached(
    files: tuple[tuple[str, int, int], ...], n_adapters: int, options: RunnerOptions
) -> MemoryEstimate:
    meta = read_metadata(files[0][0])
    adapters = sum(size for _, _, size in files[1 : 1 + n_adapters])
    projector = sum(size for _, _, size in files[1 + n_adapters :])
    return estimate(meta, options, projector_bytes=projector, adapter_bytes=adapters)


@dataclass
class Server:
    """A running trioshed: what tests and the CLI may look at."""

    settings: Settings
    state: AppState
    urls: list[str]
    devices: DeviceSource

    @property
    def scheduler(self) -> Scheduler:
        return self.state.scheduler

    @property
    def base_url(self) -> str:
        return self.urls[0]


def build_scheduler(settings: Settings, devices: DeviceSource, binary: LlamaBinary, record: list[tuple[str, str]] | None = None) -> Scheduler:
    launch = LaunchConfig(
        binary=binary.path,
        env=tuple(binary.env.items()),
        load_timeout=settings.load_timeout,
        verbose=settings.runner_verbose,
        accounting_only=devices.accounting_only,
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
        estimator=estimate_model,
        place=placement.place,
        max_queue=settings.max_queue,
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


def _notify_systemd(message: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as exc:
            log.warning("systemd notify failed: %s", exc)


async def serve(
    settings: Settings,
    *,
    binary: LlamaBinary | None = None,
    handle_signals: bool = True,
    record: list[tuple[str, str]] | None = None,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when ``handle_signals``)."""
    binary = binary or find_llama_server(settings.llama_server)
    await check_addresses(settings.rpc_servers, allow_public=settings.rpc_allow_public)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request otherwise
    devices = discover(settings.devices)
    scheduler = build_scheduler(settings, devices, binary, record)
    state = AppState(settings=settings, store=Stores(settings.models), scheduler=scheduler)
    app = create_app(state)
    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.read_timeout = None
    config.graceful_timeout = 3
    config.keep_alive_timeout = 75
    log.info(
        "devices: %s (%s); llama-server: %s, %s; RPC servers: %s",
        ", ".join(f"{d.id} {d.total / 2**30:.1f} GiB" for d in devices.gpus) or "CPU only",
        devices.kind,
        await llama_build(binary),
        binary.path,
        ", ".join(s.address for s in settings.rpc_servers) or "none",
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        catalogue = state.store.catalogue()  # parsed now: its problems are logged at start-up
        if catalogue.entries or catalogue.problems:
            log.info(
                "models.toml: %d models, %d problems, %d to preload",
                len(catalogue.entries), len(catalogue.problems), len(catalogue.preload),
            )  # fmt: skip
        await preload_models(state)  # before listening: the first request finds them loaded
        if handle_signals:
            nursery.start_soon(_wait_for_signals, shutdown)
        async with trio.open_nursery() as http_nursery:
            urls = await http_nursery.start(partial(hypercorn_serve, app, config, shutdown_trigger=shutdown.wait))
            urls = [u.replace("0.0.0.0", "127.0.0.1") for u in urls]
            log.info("trioshed listening on %s", ", ".join(urls))
            _notify_systemd("READY=1")
            task_status.started(Server(settings, state, urls, devices))
        # hypercorn has finished its graceful shutdown: now stop and reap the runners
        _notify_systemd("STOPPING=1")
        nursery.cancel_scope.cancel(reason="shutdown")


async def _wait_for_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            shutdown.set()
            return
