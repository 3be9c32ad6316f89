"""The test helper that runs ``llama-server`` alone (``trioshed.testing.llama``), under other
processes that take ports: the suite runs llama-servers side by side, and a port chosen free can
be taken before the child binds it. Then the helper must not take another process's ``/health``
for its child's, and must start the child again on another port."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trioshed.testing import llama
from trioshed.testing.tiny import write_tiny_model


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def foreign_port() -> Iterator[int]:
    """A port held by another server that answers every GET 200."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_a_port_taken_before_the_child_binds_it_is_replaced(tmp_path: Path, foreign_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model)
    ports = iter([foreign_port])
    chosen: list[int] = []

    def free_port() -> int:
        port = next(ports, None) or _really_free()
        chosen.append(port)
        return port

    monkeypatch.setattr(llama, "free_port", free_port)
    report = llama.measure_load(model, ["-t", "1", "-c", "256"], timeout=60)
    assert len(chosen) == 2 and chosen[0] == foreign_port
    assert f"--port {chosen[1]}" in " ".join(report.argv)
    assert report.memory is not None  # the child's own load, not the other server's answer


def _really_free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
