"""The servers a benchmark starts: direct ``llama-server``s, llama.cpp's router, trioshed.

Each is an async context manager that starts the process in a new session (its own process
group), waits until its readiness URL answers 200 and yields a :class:`Server`; leaving the
block stops the whole process tree: SIGTERM to the group, a grace period, SIGKILL to the group
and to any descendant that left it, then reaps. An ``atexit`` hook kills whatever a crash left
behind, so a benchmark never leaves a ``llama-server`` running.

No parent-death signal here: trio spawns children from a worker thread, and Linux delivers
``PR_SET_PDEATHSIG`` when that *thread* exits, which trio's thread cache does after idling.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import trio

#: Process groups started here and not yet stopped; the atexit hook kills them.
_LIVE_GROUPS: set[int] = set()
#: Processes of ours (roots and their descendants) still alive after their tree was stopped.
LEAKED: list[str] = []
STOP_GRACE = 5.0
_REPO = str(Path(__file__).resolve().parent.parent)  # where ``bench`` imports from
LOG_TAIL_BYTES = 4000
T = TypeVar("T")


class ServerFailed(RuntimeError):
    """A server exited or never became ready; the message carries the tail of its log."""


def _kill_leftovers() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    _LIVE_GROUPS.clear()


atexit.register(_kill_leftovers)


class Terminated(Exception):
    """SIGTERM or SIGHUP arrived; everything started was stopped before this was raised."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


async def run_until_signalled(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn()``; on SIGTERM or SIGHUP cancel it (so every server it started is stopped and
    reaped by its own ``finally``) and raise :class:`Terminated`. Ctrl-C stays trio's
    KeyboardInterrupt, which unwinds the same way. Without this a plain ``kill`` would end
    Python at once and leave the children (in their own sessions) running."""
    got: list[int] = []
    result: list[T] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                async for signum in signals:
                    got.append(signum)
                    nursery.cancel_scope.cancel(reason=f"signal {signum}")
                    return

        async def work() -> None:
            result.append(await fn())
            nursery.cancel_scope.cancel(reason="done")

        nursery.start_soon(watch)
        nursery.start_soon(work)
    if got:
        raise Terminated(got[0])
    return result[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_server_binary() -> tuple[str, dict[str, str]]:
    """``(binary, env)`` exactly as trioshed resolves its runner binary
    (``trioshed.runner.binary.find_llama_server``: ``TRIOSHED_LLAMA_SERVER``, the build
    ``make install`` chose for this CPU, the bundled wheel, ``PATH``), so that every target runs
    the same binary; trioshed is also given it explicitly."""
    try:
        from trioshed.runner.binary import find_llama_server
    except ImportError:  # an older tree: the test helper's lookup
        from trioshed.testing.llama import llama_server_binary as resolve

        return resolve()
    found = find_llama_server()
    return found.path, dict(found.env)


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class Server:
    """A started, ready server process (the root of its process tree)."""

    name: str
    base_url: str
    process: trio.Process
    argv: list[str]
    log_path: Path
    ready_after: float  # seconds from spawn to the first 200 from the readiness URL
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss(self, *, tree: bool = False) -> int:
        """Resident bytes of the root process (``tree``: plus all its descendants)."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)] if tree else [root]
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            return total
        except psutil.Error:
            return 0

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []


async def wait_ready(
    process: trio.Process, url: str, log_path: Path, *, limit: float, name: str
) -> None:
    """Poll ``url`` until it answers 200; fail at once, with the log's tail, if the process exits.

    ``verify=False``: plain HTTP on loopback, and httpx's default TLS context costs ~90 ms to
    build here (it loads the CA bundle), which would land inside every measured cold start.
    """
    async with httpx.AsyncClient(trust_env=False, timeout=2.0, verify=False) as client:
        try:
            with trio.fail_after(limit):
                while True:
                    if process.poll() is not None:
                        raise ServerFailed(
                            f"{name} exited with code {process.returncode} before it was ready; "
                            f"last output:\n{log_tail(log_path)}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        resp = await client.get(url)
                        if resp.status_code == 200:
                            return
                    await trio.sleep(0.005)  # fine-grained: cold starts are measured with this
        except trio.TooSlowError:
            raise ServerFailed(
                f"{name} was not ready after {limit:g} s; last output:\n{log_tail(log_path)}"
            ) from None


async def stop_tree(process: trio.Process, *, grace: float = STOP_GRACE) -> None:
    """SIGTERM the process group, wait ``grace``, SIGKILL the group and any descendant that
    left it, reap. Call shielded."""
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    pgid = process.pid
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGTERM)
    with trio.move_on_after(grace):
        await process.wait()
        # the root is gone; give its children the rest of the grace period
        while any(_alive(p) for p in descendants):  # noqa: ASYNC110 - not our children: no event to wait on
            await trio.sleep(0.05)
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            if _alive(p):
                p.kill()
    await process.wait()
    with trio.move_on_after(grace):
        while any(_alive(p) for p in descendants):  # noqa: ASYNC110 - not our children: no event to wait on
            await trio.sleep(0.05)
    _LIVE_GROUPS.discard(pgid)
    for p in descendants:
        if _alive(p):
            with contextlib.suppress(psutil.Error):
                LEAKED.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@asynccontextmanager
async def open_server(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    base_url: str,
    ready_path: str,
    log_path: Path,
    ready_timeout: float = 120.0,
    cwd: Path | None = None,
) -> AsyncIterator[Server]:
    """Start ``argv`` in its own session (in ``cwd``), wait for ``base_url + ready_path``, yield, stop.

    Cancellation: a cancel while starting or while in use stops and reaps the tree (shielded)
    before it propagates.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        t0 = time.perf_counter()
        process = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            cwd=cwd,
        )
        _LIVE_GROUPS.add(process.pid)
        try:
            await wait_ready(
                process, base_url + ready_path, log_path, limit=ready_timeout, name=name
            )
            yield Server(
                name=name,
                base_url=base_url,
                process=process,
                argv=list(argv),
                log_path=log_path,
                ready_after=time.perf_counter() - t0,
            )
        finally:
            with trio.CancelScope(shield=True):
                await stop_tree(process)


@dataclass(frozen=True)
class RunnerFlags:
    """The runner settings every target gets alike: threads, slots, context per slot."""

    threads: int = 1
    parallel: int = 4
    ctx_per_slot: int = 1024
    batch: int = 512

    def llama_args(self) -> list[str]:
        """The flags trioshed's runner passes (``trioshed/runner/command.py``), less ``--verbose``."""
        return [
            "--threads", str(self.threads),
            "--parallel", str(self.parallel),
            "--ctx-size", str(self.ctx_per_slot * self.parallel),
            "--batch-size", str(self.batch),
            "--fit", "off",
            "--n-gpu-layers", "0",
            "--device", "none",
            "--flash-attn", "on",
            "--no-webui",
            "--log-colors", "off",
        ]  # fmt: skip


@asynccontextmanager
async def open_direct(
    model: str, path: Path, flags: RunnerFlags, log_dir: Path, *, ready_timeout: float = 120.0
) -> AsyncIterator[Server]:
    """One plain ``llama-server`` for one model: the physical limit, no proxy in between."""
    binary, env = llama_server_binary()
    port = free_port()
    argv = [binary, "--model", str(path), "--host", "127.0.0.1", "--port", str(port),
            "--alias", model, *flags.llama_args()]  # fmt: skip
    async with open_server(
        f"direct:{model}", argv, env=env, base_url=f"http://127.0.0.1:{port}",
        ready_path="/health", log_path=log_dir / f"direct-{model}-{port}.log",
        ready_timeout=ready_timeout,
    ) as server:  # fmt: skip
        yield server


@asynccontextmanager
async def open_router(
    models_dir: Path, models_max: int, flags: RunnerFlags, log_dir: Path,
    *, ready_timeout: float = 120.0,
) -> AsyncIterator[Server]:
    """llama.cpp's own router: ``llama-server --models-dir DIR --models-max N``, requests routed
    by their ``model`` field to children it starts and evicts itself (it forwards the other
    flags to its children)."""
    binary, env = llama_server_binary()
    port = free_port()
    argv = [binary, "--models-dir", str(models_dir), "--models-max", str(models_max),
            "--host", "127.0.0.1", "--port", str(port), *flags.llama_args()]  # fmt: skip
    async with open_server(
        f"router(max {models_max})", argv, env=env, base_url=f"http://127.0.0.1:{port}",
        ready_path="/health", log_path=log_dir / f"router-max{models_max}-{port}.log",
        ready_timeout=ready_timeout,
    ) as server:  # fmt: skip
        yield server


@asynccontextmanager
async def open_trioshed(
    models_dir: Path, flags: RunnerFlags, log_dir: Path, *,
    max_loaded: int, max_queue: int = 512, keep_alive: str = "-1",
    extra_env: Mapping[str, str] | None = None, ready_timeout: float = 60.0, ready_path: str = "/api/version",
    source: Path | None = None, name: str = "",
) -> AsyncIterator[Server]:
    """``python -m trioshed serve`` over ``models_dir`` with the same binary and runner flags
    (``ready_path``: ``/ui`` for a server with API keys, which answers it without one;
    ``source``: another checkout's ``trioshed`` instead of this one, for side-by-side runs)."""
    binary, env = llama_server_binary()
    port = free_port()
    env = dict(env)
    env.update({
        "TRIOSHED_HOST": f"127.0.0.1:{port}",
        "TRIOSHED_MODELS": str(models_dir),
        "TRIOSHED_MAX_LOADED_MODELS": str(max_loaded),
        "TRIOSHED_NUM_PARALLEL": str(flags.parallel),
        "TRIOSHED_NUM_THREAD": str(flags.threads),
        "TRIOSHED_CONTEXT_LENGTH": str(flags.ctx_per_slot),
        "TRIOSHED_MAX_QUEUE": str(max_queue),
        "TRIOSHED_KEEP_ALIVE": keep_alive,
        "TRIOSHED_LLAMA_SERVER": binary,
        # like the direct llama-servers it is compared with; bench.speculation measures it
        "TRIOSHED_SPECULATION": "off",
    })  # fmt: skip
    env.update(extra_env or {})
    argv = [sys.executable, "-m", "trioshed", "serve"]
    async with open_server(
        name or f"trioshed(max {max_loaded})", argv, env=env, base_url=f"http://127.0.0.1:{port}",
        ready_path=ready_path, log_path=log_dir / f"trioshed-max{max_loaded}-{port}.log",
        ready_timeout=ready_timeout, cwd=source,
    ) as server:  # fmt: skip
        yield server


@asynccontextmanager
async def open_floor(kind: str, log_dir: Path, *, ready_timeout: float = 60.0) -> AsyncIterator[Server]:
    """``python -m bench.floor KIND PORT``: hypercorn alone or quart-trio alone (the inbound floor)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_REPO, env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "bench.floor", kind, str(port)]
    async with open_server(
        f"floor-{kind}", argv, env=env, base_url=f"http://127.0.0.1:{port}", ready_path="/",
        log_path=log_dir / f"floor-{kind}-{port}.log", ready_timeout=ready_timeout,
    ) as server:  # fmt: skip
        yield server
