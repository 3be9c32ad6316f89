"""A PostgreSQL server of its own, for tests and the bench: Debian's ``initdb`` and ``pg_ctl``
in a temporary folder, on a free loopback port, its unix socket in that folder; stopped (and
its folder removed) on exit, so no ``postgres`` process outlives its user.

As root it runs as the ``postgres`` user (PostgreSQL refuses root). The server asks for a
password on TCP (scram-sha-256), so tests see a URL with a password in it, as a team's would be.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trioshed.testing.llama import free_port

PASSWORD = "pg-secret-7f3a"


def find_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(folder) / "initdb").exists():
            return Path(folder)
    return None


@dataclass
class Postgres:
    bin: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres:{PASSWORD}@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 60) -> None:
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def init(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(pwfile, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth-local=trust", "--auth-host=scram-sha-256",
                  f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync", "--no-instructions")  # fmt: skip

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stop it (fast: sessions cut, what was committed kept)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def kill_leftover(self) -> None:
        pid_file = self.data / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            os.kill(pid, signal.SIGQUIT)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)


@contextmanager
def running_postgres() -> Iterator[Postgres]:
    """A new PostgreSQL server, running; stopped and removed on exit. RuntimeError without one."""
    folder = find_bin()
    if folder is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="trioshed-pg-"))
    pg = Postgres(folder, root, free_port())
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        try:
            pg.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        pg.kill_leftover()
        shutil.rmtree(root, ignore_errors=True)
