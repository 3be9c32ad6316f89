"""llama.cpp RPC servers on loopback for tests and benchmarks: started, waited for, reaped."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from trioshed.runner.binary import find_rpc_server
from trioshed.testing.llama import free_port


@dataclass
class RpcServerProcess:
    """One ``rpc-server`` child listening on 127.0.0.1:``port``."""

    port: int
    process: subprocess.Popen[bytes]
    argv: list[str]
    env: dict[str, str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """Start it again on the same port (after :meth:`kill`)."""
        self.kill()
        self.process = _spawn(self.argv, self.env)
        wait_listening(self.port, self.process)


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Until a TCP connect succeeds (closed at once, nothing sent: harmless to an rpc-server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rpc-server on port {port} exited with code {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.02)
    raise TimeoutError(f"rpc-server on port {port} did not listen within {timeout:.0f}s")


@contextlib.contextmanager
def rpc_servers(count: int, *, threads: int = 1) -> Iterator[list[RpcServerProcess]]:
    """``count`` rpc-servers (CPU backend, ``threads`` threads each) on loopback; killed and reaped
    on exit. Raises ``BinaryNotFound`` when there is no rpc-server binary."""
    servers: list[RpcServerProcess] = []
    try:
        for _ in range(count):
            servers.append(start_rpc_server(free_port(), threads=threads))
        yield servers
    finally:
        for server in servers:
            server.kill()


def start_rpc_server(port: int, *, threads: int = 1) -> RpcServerProcess:
    """One rpc-server on 127.0.0.1:``port``, listening when this returns (the caller kills it)."""
    binary = find_rpc_server()
    argv = [binary.path, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads)]
    server = RpcServerProcess(port, _spawn(argv, binary.env), argv, binary.env)
    try:
        wait_listening(port, server.process)
    except BaseException:
        server.kill()
        raise
    return server
