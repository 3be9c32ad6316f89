"""Blob uploads (``POST /api/blobs/<digest>``): constant memory through a real server, the
partial file of a killed upload reclaimed, and the OS's refusals to open a file answered with
their own status (403, 503, 507), never a 500."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import trio
import trio.testing

from tests.support.serve_process import serve_process
from trioshed.errors import Forbidden, InsufficientStorage, OutOfFiles
from trioshed.models.blobs import (
    UPLOAD_SUFFIX,
    import_file,
    receive_blob,
    reclaim_uploads,
    write_blob,
)
from trioshed.testing.server import open_test_server

MiB = 1 << 20
ZEROS = bytes(MiB)


async def _zeros(n: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield ZEROS


def _digest_of_zeros(n: int) -> str:
    h = hashlib.sha256()
    for _ in range(n):
        h.update(ZEROS)
    return f"sha256:{h.hexdigest()}"


async def test_a_200_mib_upload_grows_the_servers_rss_by_less_than_64_mib(tmp_path: Path) -> None:
    n = 200
    digest = await trio.to_thread.run_sync(_digest_of_zeros, n)
    with trio.fail_after(60):
        async with serve_process(tmp_path / "models") as server:
            proc = psutil.Process(server.process.pid)
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                warm = await http.post(f"/api/blobs/{_digest_of_zeros(1)}", content=ZEROS)  # imports, first thread
                assert warm.status_code == 201
                before = proc.memory_info().rss
                peak = before
                done = trio.Event()

                async def sample() -> None:
                    nonlocal peak
                    while not done.is_set():
                        peak = max(peak, proc.memory_info().rss)
                        await trio.sleep(0.01)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample)
                    answer = await http.post(f"/api/blobs/{digest}", content=_zeros(n), headers={"Content-Length": str(n * MiB)})
                    done.set()
                assert answer.status_code == 201, answer.text
                peak = max(peak, proc.memory_info().rss)
    stored = tmp_path / "models" / "pulled" / "blobs" / f"sha256-{digest[7:]}"
    assert stored.stat().st_size == n * MiB
    assert peak - before < 64 * MiB, f"RSS grew by {(peak - before) / MiB:.0f} MiB"


async def test_an_upload_is_read_only_as_fast_as_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk held (every blob write waits at a hold point): the client can send no more than
    the server's bound plus the sockets' buffers; released, the upload completes."""
    n = 128
    digest = await trio.to_thread.run_sync(_digest_of_zeros, n)
    release = trio.Event()
    original = trio.to_thread.run_sync

    async def held(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(fn, "__name__", "") == "write":  # the blob's writes (hash and write)
            await release.wait()
        return await original(fn, *args, **kwargs)

    with trio.fail_after(60):
        async with open_test_server(tmp_path / "models") as server:
            monkeypatch.setattr(trio.to_thread, "run_sync", held)
            host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
            sent = 0
            async with await trio.open_tcp_stream(host, int(port)) as sock:

                async def send() -> None:
                    nonlocal sent
                    head = f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {n * MiB}\r\n\r\n"
                    await sock.send_all(head.encode())
                    for _ in range(n):
                        await sock.send_all(ZEROS)
                        sent += MiB

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                    assert sent < 64 * MiB, f"{sent / MiB:.0f} MiB taken while nothing could be written"
                    release.set()
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await sock.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 201"), answer


async def test_a_client_that_leaves_mid_upload_leaves_no_partial_file(tmp_path: Path) -> None:
    digest = _digest_of_zeros(64)
    blobs = tmp_path / "models" / "pulled" / "blobs"
    with trio.fail_after(60):
        async with serve_process(tmp_path / "models") as server:
            host, port = server.url.removeprefix("http://").rsplit(":", 1)
            sock = await trio.open_tcp_stream(host, int(port))
            async with sock:
                head = f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {64 * MiB}\r\n\r\n"
                await sock.send_all(head.encode())
                for _ in range(8):
                    await sock.send_all(ZEROS)
                while not [p for p in blobs.glob("*") if p.name.endswith(UPLOAD_SUFFIX)]:  # noqa: ASYNC110  (a child's files)
                    await trio.sleep(0.01)  # the upload is being written
            while list(blobs.glob("*")):  # noqa: ASYNC110  (the server saw the disconnect and removed it)
                await trio.sleep(0.01)
            async with httpx.AsyncClient(base_url=server.url) as http:
                assert (await http.get("/api/version")).status_code == 200


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trioshed.models.blobs import _Upload
    upload = _Upload(Path(sys.argv[1]))
    upload.write(b"half of a blob")
    print(upload.path, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_uploads_partial_file_is_reclaimed_by_the_next_upload(tmp_path: Path) -> None:
    """A real process holds an upload's partial file (as a server mid-upload does); while it
    lives, the next upload leaves the file alone; once it is killed (SIGKILL: no cleanup of its
    own), the next upload removes it."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    final = blobs / f"sha256-{'a' * 64}"
    data = b"GGUF a blob"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    upload = lambda: trio.run(lambda: receive_blob(tmp_path, digest, _chunks(data), length=len(data)))  # noqa: E731
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(final)], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            partial = Path(holder.stdout.readline().strip())
            assert partial.exists() and partial.name.endswith(UPLOAD_SUFFIX)
            assert upload() is True
            assert partial.exists()  # its writer lives
            holder.kill()
            holder.wait()
            assert upload() is False
            assert not partial.exists()
            assert sorted(p.name for p in blobs.iterdir()) == [f"sha256-{digest[7:]}"]
            assert reclaim_uploads(blobs) == 0
        finally:
            holder.kill()


def test_a_killed_creates_partial_file_is_reclaimed_by_the_next_blob_written(tmp_path: Path) -> None:
    """``create`` writes its blobs through the same locked partial files: one left by a killed
    writer is removed when the next blob is written, one held by a live writer is not."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    final = blobs / f"sha256-{'b' * 64}"
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(final)], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            partial = Path(holder.stdout.readline().strip())
            assert write_blob(tmp_path, b"a config") == ("sha256:" + hashlib.sha256(b"a config").hexdigest(), True)
            assert partial.exists()  # its writer lives
            holder.kill()
            holder.wait()
            _, new = write_blob(tmp_path, b"a template")
            assert new and not partial.exists()
            assert sorted(p.name for p in blobs.iterdir()) == sorted(
                f"sha256-{hashlib.sha256(d).hexdigest()}" for d in (b"a config", b"a template")
            )
        finally:
            holder.kill()


def test_a_file_copied_across_file_systems_is_verified_and_leaves_no_partial(tmp_path: Path) -> None:
    """A GGUF on another file system (no hard link possible) is copied through a locked partial
    file; the blob is its bytes, and nothing else is left in ``blobs/``."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.fail("this test needs /dev/shm on another file system than the temporary folder")
    source = Path(tempfile.mkdtemp(dir=shm)) / "model.gguf"
    try:
        source.write_bytes(b"GGUF" + bytes(range(256)) * 5000)
        digest, size, new = import_file(tmp_path, source)
        assert (digest, size, new) == ("sha256:" + hashlib.sha256(source.read_bytes()).hexdigest(), source.stat().st_size, True)
        assert [p.name for p in (tmp_path / "blobs").iterdir()] == [f"sha256-{digest[7:]}"]
        assert (tmp_path / "blobs" / f"sha256-{digest[7:]}").read_bytes() == source.read_bytes()
        assert import_file(tmp_path, source)[2] is False
    finally:
        shutil.rmtree(source.parent)


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


OPEN_FAILURE = textwrap.dedent(
    """
    import os, resource, sys
    from pathlib import Path
    import trio
    from trioshed.errors import TrioshedError
    from trioshed.models.blobs import receive_blob

    async def chunks():
        yield b"GGUF"

    async def main(root, how):
        await trio.to_thread.run_sync(lambda: None)  # the worker thread exists before the limit
        held = []
        if how == "emfile":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
        elif how == "eacces":
            os.setgid(65534)
            os.setuid(65534)
        try:
            await receive_blob(Path(root), "sha256:" + "0" * 64, chunks(), length=4)
        except TrioshedError as exc:
            print(exc.status, type(exc).__name__, exc.message)
        for fd in held:
            os.close(fd)

    trio.run(main, sys.argv[1], sys.argv[2])
    """
)


def _open_failure(root: Path, how: str) -> str:
    done = subprocess.run([sys.executable, "-c", OPEN_FAILURE, str(root), how], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_no_file_descriptor_left_is_503_not_500(tmp_path: Path) -> None:
    """RLIMIT_NOFILE lowered in a child, every descriptor taken: open() fails with EMFILE."""
    out = _open_failure(tmp_path, "emfile")
    assert out.startswith(f"503 {OutOfFiles.__name__} cannot write the blob into the store"), out
    assert not list(tmp_path.rglob("*-partial"))


def test_a_store_folder_that_may_not_be_written_is_403_not_500(tmp_path: Path) -> None:
    """A folder the server may not write (as root: root's own folder, mode 0o755, and the child
    drops to nobody; as another user: the folder made read-only, 0o500): open() fails with EACCES."""
    if os.geteuid() == 0:
        root = Path(tempfile.mkdtemp(prefix="trioshed-eacces-"))  # outside pytest's 0o700 folder
        root.chmod(0o755)
        how = "eacces"
    else:
        root = tmp_path / "store"
        how = "none"
    try:
        (root / "blobs").mkdir(parents=True)
        if how == "none":
            (root / "blobs").chmod(0o500)
        out = _open_failure(root, how)
        (root / "blobs").chmod(0o755)
        assert out.startswith(f"403 {Forbidden.__name__} cannot write the blob into the store: Permission denied"), out
        assert list((root / "blobs").iterdir()) == []
    finally:
        (root / "blobs").chmod(0o755)
        shutil.rmtree(root)


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs with room for no more files (3 inodes: the root and two folders)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=3", "tmpfs", str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_full_file_system_is_507_not_500(full_tmpfs: Path) -> None:
    """open() itself fails with ENOSPC (no inode left), past the free-space check."""
    (full_tmpfs / "store" / "blobs").mkdir(parents=True)
    with pytest.raises(InsufficientStorage):
        await receive_blob(full_tmpfs / "store", "sha256:" + "0" * 64, _chunks(b"GGUF"), length=4, space=lambda _: 1 << 40)
    assert list((full_tmpfs / "store" / "blobs").iterdir()) == []
