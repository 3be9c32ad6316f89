"""The ``llama-server`` that tests and benchmarks run, and measuring what it allocates.

The binary is resolved exactly as the server resolves it (``trioshed.runner.binary``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

from trioshed.core.model import MeasuredMemory
from trioshed.runner.binary import BinaryNotFound, find_llama_server

LlamaServerNotFound = BinaryNotFound


def llama_server_binary() -> tuple[str, dict[str, str]]:
    """Return ``(path, env)``: the binary to exec and the environment to exec it with.

    The same resolution as the server's (:func:`trioshed.runner.binary.find_llama_server`):
    ``TRIOSHED_LLAMA_SERVER``, else the binary ``make install`` found to run on this CPU.
    """
    binary = find_llama_server()
    return binary.path, binary.env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LoadReport:
    """What one ``llama-server`` start reported: its log and the parsed buffer sizes."""

    argv: list[str]
    log: str
    memory: MeasuredMemory | None
    output_buffers: dict[str, int]
    load_seconds: float


@dataclass
class RunningServer:
    """A ``llama-server`` child started by :func:`running_llama_server`."""

    argv: list[str]
    url: str
    process: subprocess.Popen[bytes]
    ready_after: float
    _log: IO[bytes]
    #: The whole log, set once the child has exited (after the ``with`` block).
    final_log: str | None = None

    def log_text(self) -> str:
        """Everything the child wrote so far (stdout and stderr together)."""
        if self.final_log is not None:
            return self.final_log
        return _read(self._log).decode("utf-8", errors="replace")


@contextlib.contextmanager
def running_llama_server(
    model: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    timeout: float = 60.0,
    binary: tuple[str, dict[str, str]] | None = None,
) -> Iterator[RunningServer]:
    """Start ``llama-server -v`` on ``model`` with ``args`` and yield once ``/health`` answers 200.

    Blocking on purpose (tests of pure code and benchmarks call it from plain code). The child
    never outlives the block: it is terminated, then killed after 5 s, and always waited for.
    Raises ``RuntimeError`` with the log's tail when the child exits early or is not ready within
    ``timeout`` seconds.
    """
    path, env = binary or llama_server_binary()
    for attempt in range(PORT_ATTEMPTS):
        port = free_port()
        argv = [path, "-m", str(model), "-v", "--host", "127.0.0.1", "--port", str(port), *args]
        log = tempfile.TemporaryFile(mode="w+b")
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_after = _wait_ready(proc, log, port, started, timeout)
            if ready_after is None and proc.poll() is not None and attempt + 1 < PORT_ATTEMPTS and b"couldn't bind" in _read(log):
                continue  # another process took the port between free_port() and the bind: a new one
            if ready_after is None:
                if proc.poll() is None:
                    why = f"was not ready within {timeout} s"
                else:
                    why = f"exited with code {proc.returncode} before it was ready"
                tail = "\n".join(_read(log).decode("utf-8", "replace").splitlines()[-15:])
                raise RuntimeError(f"llama-server {why}: {argv}\n{tail}")
            server = RunningServer(argv, f"http://127.0.0.1:{port}", proc, ready_after, log)
            yield server
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()
            final = _read(log).decode("utf-8", errors="replace")
            log.close()
        server.final_log = final
        return


#: Starts tried when the port chosen is taken by another process before the child binds it.
PORT_ATTEMPTS = 3


def _read(log: IO[bytes]) -> bytes:
    """What the child wrote to ``log`` so far. Read at an offset (``pread``): the child writes
    through the same open file, whose position a ``seek`` here would move under its writes."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _wait_ready(proc: subprocess.Popen[bytes], log: IO[bytes], port: int, started: float, timeout: float) -> float | None:
    """Seconds until the child answered ``/health`` 200 on ``port`` having said that it listens
    there (an answer from another process that holds the port does not count); None when it
    exited or was not ready in time."""
    listening = f"listening on http://127.0.0.1:{port}".encode()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            return None
        if listening in _read(log):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except (OSError, urllib.error.URLError):
                pass
        time.sleep(0.02)
    return None


def measure_load(
    model: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    timeout: float = 60.0,
    binary: tuple[str, dict[str, str]] | None = None,
) -> LoadReport:
    """Start ``llama-server -v`` on ``model``, wait until it is ready, stop it, parse its buffers.

    See :func:`running_llama_server` for the child's lifetime and errors.
    """
    from trioshed.runner.memlog import MemoryLogParser

    with running_llama_server(model, args, timeout=timeout, binary=binary) as server:
        pass
    text = server.log_text()
    parser = MemoryLogParser()
    for line in text.splitlines():
        parser.feed(line)
    return LoadReport(server.argv, text, parser.result(), parser.output_buffers, server.ready_after)
