"""``python -m trioshed serve`` as a real child process, for lifecycle, fault and abuse tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import psutil
import trio

from trioshed.testing.llama import free_port


@dataclass
class ServeProcess:
    process: trio.Process
    url: str
    port: int
    _log: IO[bytes]

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def runner_pids(self) -> list[int]:
        """Live llama-server children of this trioshed."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    async def wait_exit(self) -> int:
        return await self.process.wait()


@asynccontextmanager
async def serve_process(store: Path, port: int | None = None, **env: str) -> AsyncIterator[ServeProcess]:
    """Start trioshed on ``port`` (default: a free one) with one runner thread; yield once ``GET /``
    answers.

    The child is always stopped (SIGKILL if it is still running at the end) and reaped.
    """
    port = port or free_port()
    full_env = {
        **os.environ,
        "TRIOSHED_MODELS": str(store),
        "TRIOSHED_HOST": f"127.0.0.1:{port}",
        "TRIOSHED_NUM_THREAD": "1",
        **env,
    }
    with tempfile.TemporaryFile() as log:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trioshed", "serve"], env=full_env, stdout=log, stderr=subprocess.STDOUT
        )
        served = ServeProcess(process, f"http://127.0.0.1:{port}", port, log)
        try:
            with trio.fail_after(30):
                key = env.get("TRIOSHED_API_KEY")
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with httpx.AsyncClient(base_url=served.url, headers=headers) as http:
                    while True:
                        if process.poll() is not None:
                            raise RuntimeError(f"trioshed exited with {process.returncode}: {served.log()[-2000:]}")
                        try:
                            if (await http.get("/")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.05)
            yield served
        finally:
            pids = served.runner_pids()
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()
            for pid in pids:  # the parent-death signal stops them; make sure
                try:
                    psutil.Process(pid).wait(10)
                except psutil.Error:
                    pass
