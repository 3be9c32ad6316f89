"""The folder of saved slots (warm returns): files, budget, integrity. Blocking file I/O, called
from worker threads (``trio.to_thread.run_sync``); the decisions are ``trioshed.core.kvcache``'s.

Layout: llama-server writes ``partial-<random>.bin`` (it is started with ``--slot-save-path``
set to this folder and only ever given names that this module chose). Once the save answered,
:meth:`SlotStore.commit` checks the file's header, renames it to ``<key>-<tokens>.bin`` and
writes the sidecar ``<key>-<tokens>.json`` (size, CRC-32, times) through a temporary file and a
rename: the sidecar is the commit point. A crash at any moment leaves either a committed pair
or files without a sidecar, which :meth:`SlotStore.open` deletes (once ten minutes old); a
``partial-`` file is never restored. Before a restore, :meth:`SlotStore.verify` checks size and CRC-32 (0.7 ms per MiB
here; llama-server itself accepts a file whose KV bytes were flipped), and deletes a bad file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from trioshed.core.kvcache import (
    FileIdentity,
    SavedSlot,
    TokenChain,
    entry_name,
    plan_room,
    sample_ranges,
    slot_file_tokens,
)

log = logging.getLogger(__name__)

TEMP_PREFIX = "partial-"
#: Seconds after which an uncommitted file is a crash's leftover, not a save in progress.
STALE_AFTER = 600.0
_CHUNK = 1 << 20


def file_identity(path: str) -> FileIdentity:
    """``path``'s size, modification time and a CRC of sampled bytes (see ``sample_ranges``)."""
    st = os.stat(path)
    crc = 0
    with open(path, "rb") as f:
        for offset, length in sample_ranges(st.st_size):
            f.seek(offset)
            crc = zlib.crc32(f.read(length), crc)
    return FileIdentity(os.path.realpath(path), st.st_size, st.st_mtime_ns, f"{crc:08x}")


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _crc_of(path: str | Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _read_tokens(path: str | Path) -> Sequence[int]:
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) == 12:
            n = int.from_bytes(head[8:12], "little")
            head += f.read(4 * n)
    return slot_file_tokens(head)


def _write_json(path: str, data: dict[str, object]) -> None:
    """Write ``data`` to ``path`` all or nothing: a temporary file, fsync, rename."""
    temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{secrets.token_hex(6)}.json")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        _unlink(temp)
        raise


class SlotStore:
    """Saved slots under ``folder`` within ``budget`` bytes (0: warm returns are off).

    Thread-safe: runners save and restore concurrently from worker threads.
    """

    def __init__(self, folder: Path, budget: int) -> None:
        self.folder = Path(folder)
        self.budget = budget
        self._lock = threading.Lock()  # the index
        self._commit = threading.Lock()  # one commit at a time: the budget holds between them
        self._dir = os.fspath(self.folder)
        self._entries: dict[str, SavedSlot] = {}
        #: How many files each key has: every request asks whether its key has one (a scan of the
        #: index cost 70 us a request at 800 files), so it is kept as the index changes.
        self._keys: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def open(self) -> None:
        """Create the folder (private), delete what a crash left, and index the saved slots."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        entries: dict[str, SavedSlot] = {}
        names = {p.name for p in self.folder.iterdir()}
        for name in sorted(names):
            path = self.folder / name
            stem, suffix = os.path.splitext(name)
            if name.startswith(TEMP_PREFIX) or (suffix == ".bin" and f"{stem}.json" not in names):
                # A save cut short, or never committed; one younger than STALE_AFTER may be
                # another trioshed's save in progress (one folder per trioshed is expected).
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > STALE_AFTER:
                        path.unlink()
                continue
            if suffix != ".json":
                continue
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
                entries[stem] = SavedSlot(
                    stem, sys.intern(str(meta["key"])), TokenChain.of(_read_tokens(self._file(stem, ".bin"))), int(meta["size"]),
                    int(meta["crc32"]), float(meta["saved_at"]), float(meta["used_at"]),
                )  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("warm returns: dropping unreadable saved slot %s: %s", stem, exc)
                self._delete(stem)
        with self._lock:
            self._entries = entries
            self._keys = Counter(e.key_id for e in entries.values())
        if self.enabled:
            self.make_room(0)  # the budget may have shrunk since the files were written

    def entries(self) -> list[SavedSlot]:
        with self._lock:
            return list(self._entries.values())

    def has_key(self, key_id: str) -> bool:
        with self._lock:
            return key_id in self._keys

    def _put(self, entry: SavedSlot) -> None:
        """Index ``entry`` (replacing its name's); the index lock is held."""
        self._pop(entry.name)
        self._entries[entry.name] = entry
        self._keys[entry.key_id] += 1

    def _pop(self, name: str) -> None:
        """Unindex ``name``, if indexed; the index lock is held."""
        old = self._entries.pop(name, None)
        if old is not None:
            self._keys[old.key_id] -= 1
            if self._keys[old.key_id] <= 0:
                del self._keys[old.key_id]

    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def path_of(self, name: str) -> Path:
        return self.folder / f"{name}.bin"

    def _file(self, name: str, suffix: str) -> str:
        # A plain string: a Path interns each of its parts (CPython 3.11), and this runs for every
        # file saved, so the interpreter's table of interned strings would grow with the files.
        return os.path.join(self._dir, name + suffix)

    def temp_name(self) -> str:
        """A file name for llama-server to save into (never restored until committed)."""
        return f"{TEMP_PREFIX}{secrets.token_hex(8)}.bin"

    def make_room(self, incoming: int) -> bool:
        """Delete least recently used files so that ``incoming`` bytes fit; False (and nothing
        deleted) when they cannot fit the budget at all."""
        with self._lock:
            drop = plan_room(self._entries.values(), self.budget, incoming)
            if drop is None:
                return False
            for name in drop:
                self._pop(name)
        for name in drop:
            log.info("warm returns: evicting saved slot %s (disk budget %d bytes)", name, self.budget)
            self._delete(name)
        return True

    def commit(self, temp: str, key_id: str, now: float) -> SavedSlot | None:
        """Make the finished save ``temp`` a saved slot of ``key_id``; None (and the file
        deleted) when it is empty, not a slot file, or larger than the budget."""
        path = self._file(temp, "")
        try:
            tokens = _read_tokens(path)
            size = os.stat(path).st_size
            if not tokens:
                raise ValueError("empty slot")
            crc = _crc_of(path)
        except (OSError, ValueError) as exc:
            log.info("warm returns: not keeping save %s: %s", temp, exc)
            _unlink(path)
            return None
        name = entry_name(key_id, tokens)
        entry = SavedSlot(name, key_id, TokenChain.of(tokens), size, crc, now, now)
        with self._commit:
            with self._lock:
                self._pop(name)  # the same conversation saved again replaces it
            if not self.make_room(size):
                log.info("warm returns: a saved slot of %d bytes exceeds the disk budget %d", size, self.budget)
                _unlink(path)
                self._delete(name)
                return None
            try:
                os.replace(path, self._file(name, ".bin"))
                _write_json(self._file(name, ".json"), self._sidecar(entry))
            except OSError as exc:
                log.warning("warm returns: cannot keep save %s: %s", temp, exc)
                _unlink(path)
                self._delete(name)
                return None
            with self._lock:
                self._put(entry)
        return entry

    def discard(self, temp: str) -> None:
        """Delete an unfinished save."""
        _unlink(self._file(temp, ""))

    def verify(self, entry: SavedSlot) -> bool:
        """Whether ``entry``'s file is whole (size and CRC-32); a bad one is deleted."""
        path = self._file(entry.name, ".bin")
        try:
            ok = os.stat(path).st_size == entry.size and _crc_of(path) == entry.checksum
        except OSError:
            ok = False
        if not ok:
            log.warning("warm returns: saved slot %s is corrupt or missing; deleting it", entry.name)
            self.remove(entry.name)
        return ok

    def touch(self, name: str, now: float) -> None:
        """Mark ``name`` used now (least recently used files are evicted first)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry = replace(entry, used_at=now)
            self._put(entry)
        with contextlib.suppress(OSError):
            _write_json(self._file(name, ".json"), self._sidecar(entry))

    def remove(self, name: str) -> None:
        with self._lock:
            self._pop(name)
        self._delete(name)

    def _delete(self, name: str) -> None:
        for suffix in (".json", ".bin"):  # sidecar first: a bin without one is never restored
            _unlink(self._file(name, suffix))

    @staticmethod
    def _sidecar(entry: SavedSlot) -> dict[str, object]:
        return {
            "key": entry.key_id, "size": entry.size, "crc32": entry.checksum,
            "saved_at": entry.saved_at, "used_at": entry.used_at, "tokens": entry.n_tokens,
        }  # fmt: skip
