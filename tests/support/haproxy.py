"""packaging/haproxy.cfg run for a test: its addresses rewritten to local nodes, one backend chosen."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.paths import REPO
from trioshed.testing.llama import free_port

CONFIG = REPO / "packaging" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin"))

needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")


def config_for(nodes: Sequence[str], backend: str, front: int, stats_port: int | None = None) -> str:
    """The shipped config with ``nodes`` (base URLs) as its servers (the others removed), its
    front on ``front`` and ``backend`` as the default; with ``stats_port``, HAProxy's stats
    socket there (``show stat``: what each server was sent, retries)."""
    text = CONFIG.read_text()
    if stats_port is not None:
        text = text.replace("global\n", f"global\n    stats socket ipv4@127.0.0.1:{stats_port} level admin\n", 1)
    text = re.sub(r"bind \S+", f"bind 127.0.0.1:{front}", text)
    text = re.sub(r"default_backend \S+", f"default_backend {backend}", text)
    for i in range(1, 10):
        line = re.compile(rf"^(\s*)server node{i} \S+(.*)$", re.M)
        if i <= len(nodes):
            text = line.sub(rf"\g<1>server node{i} {nodes[i - 1].removeprefix('http://')}\g<2>", text)
        else:
            text = line.sub("", text)
    return text


@asynccontextmanager
async def run_haproxy(tmp_path: Path, nodes: Sequence[str], backend: str, *, stats_port: int | None = None) -> AsyncIterator[str]:
    """HAProxy in front of ``nodes``; yields its URL once it answers. Killed and reaped at the end."""
    assert HAPROXY is not None
    front = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config_for(nodes, backend, front, stats_port))
    log = (tmp_path / "haproxy.log").open("wb")
    proc = await trio.lowlevel.open_process([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{front}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            for _ in range(100):  # until HAProxy listens
                try:
                    await http.get("/api/version")
                    break
                except httpx.TransportError:
                    await trio.sleep(0.05)
        yield url
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()
        log.close()
