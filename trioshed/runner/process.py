"""A supervised ``llama-server`` child.

``open_llama_server()`` starts the child under ``trio.run_process`` in a nursery it owns, drains
its output into a bounded tail (and the memory-log parser), waits until ``GET /health`` answers
200, and yields a :class:`LlamaServer`. Leaving the block stops the child: SIGTERM, a grace
period, SIGKILL, reaped. The child carries a parent-death signal, SIGKILL (a stopped child does
not act on SIGTERM until continued, so SIGTERM left orphans), so a killed trioshed leaves no orphan.

Only trioshed may talk to a child: each gets a random secret (``LLAMA_API_KEY``, in its
environment rather than on its command line, which every local user can read), sent by its
:class:`UpstreamPool`; only ``/health`` (and ``/models``) answer without it. Its CORS is closed
(``LLAMA_ARG_CORS_ORIGINS`` names an origin no page can have, without credentials): by default
llama-server echoes any ``Origin`` with credentials allowed, so any web page that found the
port could read answers past every check trioshed makes. Environment variables, because a
llama-server too old to know them ignores them where an unknown flag would stop it.

Cancellation: cancelling the enclosing scope at any point (during the load too) stops and reaps
the child before the cancellation propagates.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from trioshed._util import single_error
from trioshed.core.estimate_kv import effective_kv_type, kv_layer_bytes
from trioshed.core.media import MEDIA_MARKER, MEDIA_MARKER_VARIABLE
from trioshed.core.model import MeasuredMemory, ModelSpec, Placement, RunnerOptions
from trioshed.errors import LoadFailed
from trioshed.models.gguf_meta import unreadable
from trioshed.models.header_cache import read_header
from trioshed.models.vocab import incompatibility
from trioshed.runner.client import ConnectionFailed, UpstreamPool
from trioshed.runner.command import LaunchConfig, build_command
from trioshed.runner.output import TAIL_LINES, OutputTail
from trioshed.runner.slots import RunnerSlots, save_before_stop

try:
    from trioshed.runner.memlog import MemoryLogParser
except ImportError:  # pragma: no cover - lands with the memory-estimate work
    MemoryLogParser = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)
#: Every line a child prints, at DEBUG, as "<model> [<pid>] <line>" (``--log-level debug``).
output_log = logging.getLogger("trioshed.runner.output")

_PR_SET_PDEATHSIG = 1
#: Seconds between two reads of a serving child's output while it trickles (LlamaServer._drain);
#: a read of DRAIN_BATCH bytes or more is followed by the next at once, so that a child that
#: writes a lot (verbose, as runners are) never waits for its pipe of PIPE_BYTES.
DRAIN_PAUSE = 0.05
DRAIN_BATCH = 16384
PIPE_BYTES = 1 << 20
#: Seconds a ready runner's load log is waited for, up to its "listening on" line.
LOG_SETTLE = 1.0
#: The only origin a runner's CORS allows: reserved (RFC 2606), so no web page has it.
CLOSED_CORS_ORIGIN = "http://trioshed.invalid"


def runner_environment(base: dict[str, str] | None, secret: str) -> dict[str, str]:
    """The child's environment: ``base`` (else trioshed's), its secret, closed CORS and the
    process's media marker (:mod:`trioshed.core.media`)."""
    env = dict(base) if base else dict(os.environ)
    env["LLAMA_API_KEY"] = secret
    env["LLAMA_ARG_CORS_ORIGINS"] = CLOSED_CORS_ORIGIN
    env["LLAMA_ARG_CORS_CREDENTIALS"] = "false"
    env[MEDIA_MARKER_VARIABLE] = MEDIA_MARKER  # where a transcript's images and sounds go
    env.pop("LLAMA_ARG_API_KEY_FILE", None)  # would add keys trioshed does not hold
    return env


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ChildProcess:
    """A spawned child watched through a pidfd (Linux): ``await wait()`` without a thread."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self._pidfd: int | None = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        if self._pidfd is not None:
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            finally:
                if self._popen.poll() is not None:
                    fd, self._pidfd = self._pidfd, None
                    trio.lowlevel.notify_closing(fd)
                    os.close(fd)
        return self._popen.wait()

    def send_signal(self, signum: int) -> None:
        if self._popen.poll() is None:
            self._popen.send_signal(signum)

    async def stop(self, grace: float) -> None:
        """SIGTERM, up to ``grace`` seconds, then SIGKILL; always reaped."""
        self.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.wait()
            return
        self.send_signal(signal.SIGKILL)
        await self.wait()


_SH = "/bin/sh"


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` when it can set the parent-death signal (``--pdeathsig``)."""
    path = shutil.which("setpriv")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "--pdeathsig" in out else None


def _launch(argv: list[str], env: dict[str, str] | None) -> tuple[list[str], Callable[[], None] | None]:
    """The argv to spawn and the ``preexec_fn``: the child must carry a parent-death signal.

    ``setpriv --pdeathsig KILL`` sets it, then ``/bin/sh`` checks that its parent is still
    trioshed (had trioshed died before the signal was set, it would never come) and execs the
    binary: the same pid throughout. Without a ``preexec_fn`` Python spawns with vfork: measured
    in a server-sized process, ``Popen`` took 0.3-0.6 ms against 16-17 ms with ``preexec_fn`` (a
    full fork), all of it on the Trio thread, stalling every stream during a load. Without
    ``setpriv``, or when the binary is not an executable file (Popen then raises as it always
    did), the ``preexec_fn``.
    """
    setpriv = _setpriv()
    exe = argv[0]
    if os.sep not in exe:
        exe = shutil.which(exe, path=(env if env is not None else os.environ).get("PATH")) or ""
    if setpriv is None or not os.access(_SH, os.X_OK) or not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return argv, _set_parent_death_signal
    still_ours = f'[ "$PPID" = {os.getpid()} ] && exec "$@"'
    return [setpriv, "--pdeathsig", "KILL", "--", _SH, "-c", still_ours, "llama-server", exe, *argv[1:]], None


def _spawn(argv: list[str], env: dict[str, str] | None) -> tuple[ChildProcess, trio.lowlevel.FdStream]:
    """Start the child from *this* (the Trio) thread, output merged into one pipe.

    ``trio.run_process`` forks from a worker thread, and ``PR_SET_PDEATHSIG`` fires when the
    forking *thread* exits: Trio retires idle workers after 10 s, which killed every runner
    10 s after its load (seen: exit code 0 mid-stream). Spawning from the thread that runs Trio
    ties the signal to trioshed's own life (see :func:`_launch` for what the spawn costs).
    """
    command, preexec_fn = _launch(argv, env)
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # room for the output read in batches (_drain)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB, drained at once when full
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=write_fd,
            env=env,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return ChildProcess(popen), trio.lowlevel.FdStream(read_fd)


class LlamaServer:
    """A running, ready llama-server child: its address, output and exit (the scheduler's
    :class:`~trioshed.scheduler.contracts.RunnerHandle`)."""

    def __init__(self, model: ModelSpec, options: RunnerOptions, placement: Placement, port: int) -> None:
        self.model = model
        self.options = options
        self.placement = placement
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.tail = OutputTail()
        self.process: ChildProcess | None = None
        self._exited = trio.Event()
        self._memlog = MemoryLogParser() if MemoryLogParser is not None else None
        self._progress: trio.CancelScope | None = None
        self._output_hint = trio.Event()  # set by a line saying the server is up
        self._load_logged = trio.Event()  # its "listening on" line read: the load's buffer sizes are in
        self._loaded = False  # ready once: its output is then read in batches (_drain)
        self._load_timeout = math.inf
        # The runner's pool of keep-alive connections (closed in open_llama_server before the
        # child is stopped); every request to this child goes through it.
        self.secret = secrets.token_urlsafe(32)  # the child's API key: only trioshed holds it
        self.upstream = UpstreamPool(port, max_idle=max(8, 4 * options.num_parallel), api_key=self.secret)
        #: Warm returns (saved slots), set once ready when TRIOSHED_KV_CACHE_BUDGET is not 0.
        self.slots: RunnerSlots | None = None
        self._supervision = trio.CancelScope(shield=True)  # the child's life: see _supervise

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process else None

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    @property
    def speculation(self) -> tuple[int, int]:
        """Speculative decoding so far: (tokens drafted, tokens accepted)."""
        stats = self.upstream.statistics()
        return stats.drafted, stats.accepted

    @property
    def measured(self) -> MeasuredMemory | None:
        return self._memlog.result() if self._memlog is not None else None

    async def wait_exited(self) -> int | None:
        await self._exited.wait()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child now (a hung one: a stopped process does not act on SIGTERM)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)

    async def health(self) -> bool:
        """True when the child answers ``/health`` with 200 within 10 s (the reference's ping)."""
        if self.exited:
            return False
        try:
            with trio.fail_after(10):
                status, _ = await self.upstream.get("/health")
        except (ConnectionFailed, trio.TooSlowError):
            return False
        return status == 200

    def _on_line(self, line: str) -> None:
        if output_log.isEnabledFor(logging.DEBUG):
            output_log.debug("%s [%s] %s", self.model.name, self.pid, line)
        if self._progress is not None:  # loading: output is progress, and holds the buffer sizes
            self._progress.deadline = trio.current_time() + self._load_timeout
            if self._memlog is not None:
                self._memlog.feed(line)
            if "listening on" in line or "all slots are idle" in line:
                self._output_hint.set()
            if "listening on" in line:
                self._load_logged.set()

    async def _drain(self, stream: trio.abc.ReceiveStream) -> None:
        """Read the child's output to its end. While loading, each line as it comes (progress,
        buffer sizes); once serving, a trickle at most every :data:`DRAIN_PAUSE` seconds:
        llama-server writes its log a line at a time, tens of lines for a request of many inputs,
        and each read wakes the event loop (measured: half of trioshed's CPU while indexing
        embeddings). A child blocked on a full pipe would stop serving: a large read is followed
        by the next at once, and the pipe holds :data:`PIPE_BYTES`. Once loaded, the output is
        only kept (:class:`~trioshed.runner.output.OutputTail`), not split into lines, unless
        the runners' output is logged (DEBUG)."""
        buffer = b""
        async with stream:
            while chunk := await stream.receive_some(65536):
                self.tail.feed(chunk)
                if not self._loaded or output_log.isEnabledFor(logging.DEBUG):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for raw in lines:
                        self._on_line(raw.decode("utf-8", "replace").rstrip("\r"))
                else:
                    buffer = b""
                if self._progress is None and self._loaded and len(chunk) < DRAIN_BATCH:
                    await trio.sleep(DRAIN_PAUSE)  # a trickle: let it gather (a flood is read at once)
        if buffer:
            self._on_line(buffer.decode("utf-8", "replace"))

    async def _wait_ready(self, load_timeout: float) -> None:
        self._load_timeout = load_timeout
        try:
            with trio.CancelScope(deadline=trio.current_time() + load_timeout) as self._progress:
                started = trio.current_time()
                while not self.exited:
                    with trio.move_on_after(5):
                        try:
                            status, _ = await self.upstream.get("/health")
                            if status == 200 and await self._ours():
                                # llama.cpp writes its log from a thread of its own: the buffer
                                # sizes may still be on their way when /health says ready
                                with trio.move_on_after(LOG_SETTLE):
                                    await self._load_logged.wait()
                                self._loaded = True
                                return
                        except ConnectionFailed:
                            pass
                    # Poll fast while a small model would be ready, then back off; the child's
                    # "listening" line or its exit cut the wait short.
                    delay = 0.005 if trio.current_time() - started < 2 else 0.1
                    with trio.move_on_after(delay):
                        await self._output_hint.wait()
                    self._output_hint = trio.Event()
        finally:
            self._progress = None
        # Clients see llama-server's last words without the model's path (logged in full)
        log.warning("llama-server for %s (%s) failed to load; its last output:\n%s", self.model.name, self.model.path, self.tail.text())
        if self.exited:
            raise (PortTaken if self.port_taken else LoadFailed)(
                f"llama-server exited with code {self.returncode} before it was ready; "
                f"last output: {self.scrubbed(self.tail.errors())!r}; check that the file of model "
                f"'{self.model.name}' is a valid GGUF that this llama.cpp build supports",
                returncode=self.returncode,
                stderr_tail=self.tail.text(),
            )
        raise LoadFailed(
            f"llama-server made no progress loading {self.model.name} for {load_timeout:.0f}s "
            f"(TRIOSHED_LOAD_TIMEOUT); last output: {self.scrubbed(self.tail.errors())!r}",
            stderr_tail=self.tail.text(),
        )

    async def _ours(self) -> bool:
        """Whether the server answering on this runner's port is its child: another process's
        llama-server that took the port first answers ``/health`` too, but refuses this runner's
        key (401); the child, which could not bind the port, then exits (see :func:`open_llama_server`)."""
        status, _ = await self.upstream.get("/props")
        return status != 401

    @property
    def port_taken(self) -> bool:
        """Whether the child exited because its port was taken (llama-server: "couldn't bind")."""
        return self.exited and "couldn't bind" in self.tail.text(TAIL_LINES)

    def scrubbed(self, text: str) -> str:
        """``text`` with the model's files named by the model, not by their paths."""
        for path in sorted({self.model.path, *self.model.adapters, *filter(None, [self.model.projector])}, key=len, reverse=True):
            text = text.replace(path, f"<{self.model.name}>")
            folder = os.path.dirname(path)
            if len(folder) > 1:
                text = text.replace(folder, "<store>")
        return text

    async def _supervise(self, argv: list[str], config: LaunchConfig, *, task_status: trio.TaskStatus[None]) -> None:
        """Own the child from spawn to reaping; :meth:`stop_child` stops it (SIGTERM, grace,
        SIGKILL), and nothing else does.

        Shielded from the scopes around it: a shutdown cancels every runner's scope at once,
        and the child must keep answering (and its output be read) until the runner's exit
        path has saved its slots and closed its connections. Stopped at once, a llama-server
        busy saving a slot or holding an idle keep-alive connection took its whole grace
        period (5 s) to exit: every SIGTERM to trioshed after one answer paid it.
        """
        with self._supervision:
            try:
                try:
                    self.process, output = _spawn(argv, runner_environment(dict(config.env), self.secret))
                except OSError as exc:
                    raise LoadFailed(f"cannot start llama-server {argv[0]!r}: {exc}") from None
                task_status.started()
                try:
                    await self._drain(output)
                    await self.process.wait()
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await self.process.stop(config.stop_grace)
                    raise
            finally:
                self._exited.set()
                self._output_hint.set()

    def stop_child(self, reason: str) -> None:
        """Stop the child now: SIGTERM, then SIGKILL after the grace period; always reaped."""
        self._supervision.cancel(reason=reason)


async def check_draft(model: ModelSpec, draft: str) -> None:
    """Raise LoadFailed when ``draft`` cannot draft for ``model``: llama-server would start
    anyway and serve without speculation, saying so only in its log (trioshed.models.vocab)."""
    name = model.draft or "its draft model"
    try:
        why = await trio.to_thread.run_sync(incompatibility, model.path, draft)
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"model '{model.short_name}': draft model '{name}': {unreadable(name, draft, exc).message}") from None
    if why:
        raise LoadFailed(
            f"model '{model.short_name}': draft model '{name}' cannot draft for it: {why}; "
            "a draft model needs the target's vocabulary (e.g. a smaller model of the same family): fix draft in models.toml"
        )


#: Ports tried for one runner: a port found free can be taken by another process before the
#: child binds it (the child then exits at once, saying it "couldn't bind").
PORT_ATTEMPTS = 3


class PortTaken(LoadFailed):
    """The child exited because its port was taken before it bound it (it "couldn't bind")."""


@asynccontextmanager
async def open_llama_server(
    model: ModelSpec, options: RunnerOptions, placement: Placement, config: LaunchConfig
) -> AsyncIterator[LlamaServer]:
    """Start a llama-server for ``model`` and yield it once ``/health`` answers 200.

    Raises LoadFailed (with the child's exit code and last output) when the child exits first or
    prints nothing for ``config.load_timeout`` seconds. A child whose port was taken before it
    bound it is started again on another port (:data:`PORT_ATTEMPTS` in all).
    """
    try:
        meta = await read_header(model)  # the one header cache; a miss read in a worker thread
        kv_type = effective_kv_type(options, meta)
    except (OSError, ValueError) as exc:
        raise LoadFailed(unreadable(model.name, model.path, exc).message) from None
    if options.draft:
        await check_draft(model, options.draft)
    warm = config.warm if config.warm is not None and config.warm.enabled else None
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = config.port if config.port and attempt == 1 else free_port()
        server = LlamaServer(model, options, placement, port)
        argv = build_command(
            config.binary, model, options, placement, port=port,
            verbose=config.verbose, accounting_only=config.accounting_only, kv_cache_type=kv_type,
            slot_save_path=str(warm.store.folder) if warm is not None else None, meta=meta,
        )  # fmt: skip
        try:
            with single_error(LoadFailed):
                async with trio.open_nursery() as nursery:
                    await nursery.start(server._supervise, argv, config)
                    try:
                        await server._wait_ready(config.load_timeout)
                        if warm is not None:
                            per_token = sum(kv_layer_bytes(meta, options)) // max(1, options.kv_cells)
                            server.slots = await warm.attach(model, options, kv_type, server.upstream, bytes_per_token=per_token)
                        try:
                            yield server
                        finally:
                            # Warm returns: the slots are saved before the child stops, within a bound.
                            await save_before_stop(server.slots, server.exited)
                    finally:
                        # Our idle keep-alive connections make llama-server take ~110 ms to exit on
                        # SIGTERM (under 10 ms without them): close them first.
                        with trio.move_on_after(1, shield=True):
                            await server.upstream.aclose()
                        server.stop_child("runner stopped")
        except PortTaken:
            if attempt == PORT_ATTEMPTS:
                raise
            log.info("llama-server for %s could not bind port %d (another process took it): starting it on another", model.name, port)
            continue
        return
