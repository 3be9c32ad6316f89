"""systemd's notify protocol against a real unix datagram socket; the unit file."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.paths import REPO
from trioshed import systemd
from trioshed.testing.server import open_test_server

UNIT = REPO / "packaging" / "trioshed.service"


def test_watchdog_interval_is_half_of_watchdog_usec_for_our_pid_only() -> None:
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}, 42) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 42) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 42) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "0"}, 42) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "soon"}, 42) is None
    assert systemd.watchdog_interval({}, 42) is None


def test_status_line() -> None:
    assert systemd.status_line(1, 0, 3, 2) == "serving: 1 model loaded, 0 loading, 3 queued, 2 requests in flight"
    assert systemd.status_line(2, 1, 0, 1, draining=True).startswith("draining: 2 models loaded, 1 loading")


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.setblocking(False)
    try:
        yield sock, path
    finally:
        sock.close()


async def receive(sock: socket.socket) -> str:
    trio_sock = trio.socket.from_stdlib_socket(sock.dup())
    with trio_sock:
        return (await trio_sock.recv(4096)).decode()


async def test_notifier_pings_the_watchdog_and_reports_status_changes(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    status = ["serving: a"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(systemd.run_notifier, lambda: status[0], env)
            assert await receive(sock) == "WATCHDOG=1\nSTATUS=serving: a"
            assert await receive(sock) == "WATCHDOG=1"  # unchanged status is not repeated
            status[0] = "serving: b"
            messages = [await receive(sock) for _ in range(2)]
            assert "WATCHDOG=1\nSTATUS=serving: b" in messages
            nursery.cancel_scope.cancel()


async def test_no_watchdog_for_another_pid_and_abstract_socket_addresses() -> None:
    name = f"trioshed-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    with sock, trio.fail_after(10):
        env = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(systemd.run_notifier, lambda: "idle", env)
            assert await receive(sock) == "STATUS=idle"
            nursery.cancel_scope.cancel()
    assert systemd.notify("READY=1", {}) is False


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_server_notifies_ready_status_and_stopping(
    notify_socket: tuple[socket.socket, str], model_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            assert await receive(sock) == "READY=1"
            assert await receive(sock) == "WATCHDOG=1\nSTATUS=serving: 0 models loaded, 0 loading, 0 queued, 0 requests in flight"
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200
            while "STATUS=serving: 1 model loaded" not in (message := await receive(sock)):
                assert message.startswith("WATCHDOG=1")
            server.drain.request_shutdown()
            while (message := await receive(sock)) != "STOPPING=1":
                assert message.startswith("WATCHDOG=1")


def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    unit = tmp_path / "trioshed.service"
    text = UNIT.read_text()
    # the unit names the installed binary; point it at one that exists here
    unit.write_text(text.replace("/opt/trioshed/.venv/bin/trioshed", shutil.which("true") or "/bin/true"))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in result.stderr.splitlines() if str(unit) in ln or "trioshed.service" in ln]
    assert result.returncode == 0 and not problems, result.stderr


def test_unit_file_has_watchdog_restart_user_and_gpu_access() -> None:
    text = UNIT.read_text()
    lines = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in text.splitlines() if "=" in ln and not ln.startswith("#")}
    assert lines["Type"] == "notify" and lines["WatchdogSec"] and lines["Restart"] == "on-failure"
    assert lines.get("DynamicUser") == "yes" or lines.get("User") == "trioshed"
    assert lines["EnvironmentFile"] == "-/etc/trioshed/env"
    assert "PrivateDevices" not in lines
    assert "DeviceAllow=/dev/nvidiactl rw" in text and "DeviceAllow=char-nvidia-frontend rw" in text
    assert "DeviceAllow=/dev/dri rw" in text and "DevicePolicy=closed" in text
