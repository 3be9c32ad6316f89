"""The keys of the shared store, kept in force on this node: ``serve()`` runs
:meth:`KeySync.run`, which every ``KEYS_REFRESH`` seconds reads the store's key-version counter
and, when it moved, the keys (revoked ones too), then calls ``reload`` (the gate rebuilding its
ring from the keys file, ``TRIOSHED_API_KEY`` and :attr:`KeySync.stored` less
:attr:`KeySync.revoked`). A key revoked on any node is therefore refused on every node within
``KEYS_REFRESH`` seconds plus one read of the store. The keys file is imported into the store at
start and whenever it changes on disk.

While the store cannot be read the keys last read stay in force (a revoke made meanwhile waits
for the store to be back); the keys file and ``TRIOSHED_API_KEY`` work as ever.

This module knows the recorder (whose worker thread and lock every store call goes through) and
the keys, never the HTTP edge: ``serve()`` passes the gate's rebuild in as ``reload``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from trioshed.keys import LIMIT_FIELDS, ApiKey, digest, load_keys_file
from trioshed.usage.recorder import UsageRecorder
from trioshed.usage.store import KeyRow

log = logging.getLogger(__name__)

KEYS_REFRESH = 2.0  # seconds between two reads of the key-version counter


def api_key(row: KeyRow) -> ApiKey:
    """The key a row of the store stands for (no secret: its digest)."""
    limits = {f: int(v) for f, v in row.limits.items() if f in LIMIT_FIELDS}
    return ApiKey(row.name, "", float(row.weight), role=row.role, models=tuple(row.models), digest=row.digest, **limits)  # type: ignore[arg-type]


def key_row(key: ApiKey, digest: str, now: float, source: str = "api") -> KeyRow:
    """The row to store for ``key`` (limits that are 0 are left out)."""
    limits = {f: getattr(key, f) for f in LIMIT_FIELDS if getattr(key, f)}
    return KeyRow(key.name, digest, key.role, key.weight, limits, key.models, source, now, now)


class KeySync:
    """What this node last read of the store's keys (:attr:`stored`, :attr:`revoked`), and the
    keys file's import. ``reload`` puts them in force (ValueError: refused, logged)."""

    def __init__(
        self, usage: UsageRecorder, keys_file: Path | None, reload: Callable[[], object], interval: float = KEYS_REFRESH
    ) -> None:
        self.usage = usage
        self.keys_file = keys_file
        self.reload = reload
        self.interval = interval
        self.version = -1
        self.read_at = 0.0
        #: the store's keys in force and the names revoked there (the gate merges them with the file's)
        self.stored: tuple[ApiKey, ...] = ()
        self.revoked: frozenset[str] = frozenset()
        self._file_seen: tuple[int, int] | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Import the keys file and read the keys once (before serving), then poll."""
        await self.sync()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.sync()

    async def load(self) -> bool:
        """Read the store's keys and put them in force on this node now; False when the store
        cannot be read or the keys are refused (logged)."""
        if self.usage.db is None:
            return False
        try:
            rows = await self.usage.call(lambda db: db.keys())
        except OSError:
            return False
        self.stored = tuple(api_key(r) for r in rows if r.revoked is None)
        self.revoked = frozenset(r.name for r in rows if r.revoked is not None)
        try:
            self.reload()
        except ValueError as exc:
            log.error("the store's API keys are not in force: %s", exc)
            return False
        return True

    async def sync(self) -> bool:
        """Import the keys file when it changed, then read the keys when their version moved;
        True when the keys in force changed. Faults are the recorder's to log."""
        usage = self.usage
        if usage.db is None:
            return False
        try:
            await self._import_file(usage)
            version = await usage.call(lambda db: db.keys_version())
        except OSError:
            return False
        self.read_at = time.time()
        if version == self.version:
            return False
        if not await self.load():
            return False
        self.version = version
        return True

    async def _import_file(self, usage: UsageRecorder) -> None:
        path = self.keys_file
        if path is None:
            return
        try:
            st = await trio.to_thread.run_sync(os.stat, path)
        except OSError:
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._file_seen:
            return
        try:
            keys = await trio.to_thread.run_sync(load_keys_file, path)
        except ValueError as exc:
            log.error("keys file not imported into the store: %s", exc)
            self._file_seen = seen
            return
        now = time.time()
        rows = [key_row(k, digest(k.secret), now, source="file") for k in keys]
        changed = await usage.call(lambda db: db.import_keys(rows, now))
        self._file_seen = seen
        if changed:
            log.info("keys file %s: %d key(s) imported into the store %s", path, changed, usage.where)
