"""The blobs of trioshed's Ollama-layout store (``<store>/pulled/blobs/sha256-<hex>``), and how
every writer of that store (pull, upload, create, copy) puts a file there.

* A blob is written into a ``…-partial`` file next to it, its sha256 checked, then renamed into
  place: a blob is never visible unverified nor half-written. A wrong digest removes the partial
  file and keeps nothing.
* A manifest is written last, atomically (temporary file outside ``manifests/``, fsync, rename).
* ``HEAD``/``POST /api/blobs/sha256:<hex>`` (:func:`has_blob`, :func:`receive_blob`): Ollama's
  blob upload, read only as fast as the disk takes it, hashed and written together in worker
  threads (at most :data:`UPLOAD_BATCH` bytes held); at most :data:`MAX_BLOB` bytes, and no more
  than the disk has room for (507). An upload's partial file, and those of the blobs ``create``
  writes or copies, are locked while written; one left by a killed server is removed when the
  next upload or create starts writing a blob.

Blocking helpers (files) are called from worker threads; :func:`receive_blob` is async.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import trio

from trioshed.errors import (
    BadRequest,
    Forbidden,
    InsufficientStorage,
    OutOfFiles,
    PayloadTooLarge,
    TrioshedError,
)
from trioshed.models.groups import store_changed

CHUNK = 1 << 20  # bytes hashed or written at a time
UPLOAD_BATCH = 4 << 20  # bytes of an upload held, then hashed and written in one worker-thread call
UPLOAD_SUFFIX = ".upload-partial"  # ends in -partial: pruning leaves it alone
DISK_MARGIN = 64 << 20  # room left free after a write, for manifests and the system
MAX_BLOB = 1 << 41  # 2 TiB: no layer of a real model is larger

_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_UPLOAD_PARTIAL = re.compile(r"^sha256-[0-9a-f]{64}-[0-9]+\.[0-9]+\.upload-partial$")
_unique = itertools.count()


def free_space(path: Path) -> int:
    """Bytes free on the file system holding ``path`` (its nearest existing parent)."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def digest_hex(digest: object) -> str:
    """The 64 hex digits of ``sha256:<hex>`` (``sha256-<hex>`` too), else a 400 naming it."""
    match = _DIGEST.match(digest) if isinstance(digest, str) else None
    if not match:
        raise BadRequest(f"invalid digest {str(digest)[:100]!r}: expected sha256:<64 lowercase hex digits>")
    return match.group(1)


def blob_path(root: Path, digest: object) -> Path:
    """Where the blob ``digest`` lives in the store ``root`` (validated: never a client's path)."""
    return root / "blobs" / f"sha256-{digest_hex(digest)}"


def has_blob(root: Path, digest: object) -> bool:
    return blob_path(root, digest).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_into_place(partial: Path, final: Path, hex_digest: str) -> bool:
    """Hash the complete ``partial`` file; on a match rename it to ``final``, else remove it."""
    if sha256_file(partial) != hex_digest:
        partial.unlink(missing_ok=True)
        return False
    os.replace(partial, final)
    return True


def write_blob(root: Path, data: bytes) -> tuple[str, bool]:
    """Store ``data`` as a blob of ``root``; returns its digest and whether it was new. Written
    through a locked partial file (:class:`_Upload`), so one left by a killed server is reclaimed."""
    hex_digest = hashlib.sha256(data).hexdigest()
    final = root / "blobs" / f"sha256-{hex_digest}"
    if final.is_file():
        return f"sha256:{hex_digest}", False
    partial = _open_upload(final)
    try:
        partial.write(data)
        partial.sync()
        if partial.hash.hexdigest() != hex_digest:  # pragma: no cover - the bytes just hashed
            raise TrioshedError(f"blob sha256:{hex_digest} changed while it was written")
        new = partial.place()
    finally:
        partial.discard()
    return f"sha256:{hex_digest}", new


def import_file(root: Path, source: Path) -> tuple[str, int, bool]:
    """Put a file the server already has (a folder-store GGUF) into ``root``'s blobs: a hard link
    where the file system allows, else a copy through a locked partial file, verified like any
    blob. Returns (digest, size, new)."""
    hex_digest = sha256_file(source)
    final = root / "blobs" / f"sha256-{hex_digest}"
    size = source.stat().st_size
    if final.is_file():
        return f"sha256:{hex_digest}", size, False
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, final)  # atomic: the blob appears whole or not at all
        return f"sha256:{hex_digest}", size, True
    except FileExistsError:
        return f"sha256:{hex_digest}", size, False  # another writer placed it meanwhile
    except OSError:
        pass  # another file system, or links not allowed: copy
    partial = _open_upload(final)
    try:
        with open(source, "rb") as f:
            while chunk := f.read(CHUNK):
                partial.write(chunk)
        partial.sync()
        if partial.hash.hexdigest() != hex_digest:
            raise TrioshedError(f"{source.name} changed while it was copied into the store; try again")
        new = partial.place()
    finally:
        partial.discard()
    return f"sha256:{hex_digest}", size, new


def write_manifest(root: Path, parts: tuple[str, str, str, str], data: bytes) -> Path:
    """Write a manifest atomically (temporary file outside ``manifests/``, fsync, rename)."""
    path = root.joinpath("manifests", *parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = root / f".manifest.{os.getpid()}.{next(_unique)}.tmp"  # outside manifests/: never listed
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    store_changed()  # the adapter groups are made again
    return path


class _Upload:
    """A blob's partial file (``sha256-<hex>-<pid>.<n>.upload-partial``: an upload's, or a blob
    that ``create`` writes or copies), hashed as it is written, and held under an exclusive ``flock`` for as long as this process writes it: the
    lock dies with the process, so a partial file that nobody holds was left by a killed server
    and :func:`reclaim_uploads` removes it. Blocking: call from a worker thread."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.hash = hashlib.sha256()
        while True:
            path = final.with_name(f"{final.name}-{os.getpid()}.{next(_unique)}{UPLOAD_SUFFIX}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = os.fstat(fd).st_nlink == 0  # reclaimed between the open and the lock
            except BlockingIOError:
                taken = True  # a reclaimer holds it and is removing it
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                break
            os.close(fd)
        self.path = path
        self.fd = fd

    def write(self, data: bytes | bytearray) -> None:
        """Hash and write one batch (one worker-thread call: the event loop does neither)."""
        self.hash.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def sync(self) -> None:
        os.fsync(self.fd)

    def place(self) -> bool:
        """Rename the complete, verified file into place; whether the blob was new."""
        new = not self.final.is_file()
        os.replace(self.path, self.final)
        return new

    def discard(self) -> None:
        """Close (releasing the lock); remove the partial file unless it was placed."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)


def reclaim_uploads(blobs: Path) -> int:
    """Remove the blob partial files in ``blobs`` that no live process holds (left by a server
    that was killed mid-upload or mid-create); returns how many. Blocking: call from a worker thread."""
    removed = 0
    try:
        entries = list(os.scandir(blobs))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not _UPLOAD_PARTIAL.match(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # finished (or reclaimed) meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)
            removed += 1
        except (BlockingIOError, FileNotFoundError):
            continue  # a live upload holds it, or it was placed meanwhile
        finally:
            os.close(fd)
    return removed


def _open_upload(final: Path) -> _Upload:
    final.parent.mkdir(parents=True, exist_ok=True)
    reclaim_uploads(final.parent)
    return _Upload(final)


async def receive_blob(
    root: Path,
    digest: str,
    chunks: AsyncIterator[bytes],
    *,
    length: int | None,
    space: Callable[[Path], int] = free_space,
    limit: int = MAX_BLOB,
) -> bool:
    """Stream an uploaded blob into ``root``'s blobs; rename it into place only when its sha256
    is ``digest``. Returns whether it was new (Ollama answers 201 then).

    Memory: ``chunks`` is read only while nothing is being written: at most
    :data:`UPLOAD_BATCH` bytes (plus one chunk) are held, then hashed and written in one
    worker-thread call, so a slow disk slows the reading (and the sender) down, and the event
    loop neither hashes nor writes. An upload abandoned by a killed process is removed when the
    next upload starts (:func:`reclaim_uploads`).

    400 on a mismatch (nothing kept), 413 above ``limit`` bytes, 507 when it does not fit
    (announced ``length`` checked before the first byte, the rest while it arrives, ENOSPC), 403
    when the store may not be written (EACCES, EPERM, EROFS), 503 when no file can be opened
    (EMFILE, ENFILE). Cancellation (the client left): the partial file is removed."""
    hex_digest = digest_hex(digest)
    blobs = root / "blobs"
    final = blobs / f"sha256-{hex_digest}"
    if length is not None and length > limit:
        raise PayloadTooLarge(f"a blob of {length} bytes exceeds the {limit} byte limit")
    size = 0
    upload: _Upload | None = None
    try:
        free = await trio.to_thread.run_sync(space, blobs)
        if length is not None and length + DISK_MARGIN > free:
            raise InsufficientStorage(length + DISK_MARGIN, free, str(root))
        upload = await trio.to_thread.run_sync(_open_upload, final)
        pending = bytearray()
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the blob exceeds the {limit} byte limit; nothing was kept")
            if size + DISK_MARGIN > free:
                raise InsufficientStorage(size + DISK_MARGIN, free, str(root))
            pending += chunk
            if len(pending) >= UPLOAD_BATCH:
                await trio.to_thread.run_sync(upload.write, pending)
                pending = bytearray()
        if pending:
            await trio.to_thread.run_sync(upload.write, pending)
        await trio.to_thread.run_sync(upload.sync)
        if length is not None and size != length:
            raise BadRequest(f"the upload ended after {size} of {length} bytes; nothing was kept")
        got = upload.hash.hexdigest()
        if got != hex_digest:
            raise BadRequest(f"digest mismatch: the uploaded bytes have sha256:{got}, not {digest}; nothing was kept")
        return await trio.to_thread.run_sync(upload.place)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientStorage(size + DISK_MARGIN, await trio.to_thread.run_sync(space, blobs), str(root)) from None
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise OutOfFiles("write the blob into the store") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise Forbidden(f"cannot write the blob into the store: {exc.strerror}; check the folder's permissions") from None
        raise TrioshedError(f"cannot write the blob into the store: {exc.strerror}; check the folder's permissions") from None
    finally:
        if upload is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(upload.discard)
