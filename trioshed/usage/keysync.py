"""The keys of the shared store, kept in force on this node: ``serve()`` runs :func:`run`, which
every ``KEYS_REFRESH`` seconds reads the store's key-version counter and, when it moved, the keys
(revoked ones too), then has the gate rebuild its ring (``state.reload_keys``). A key revoked on
any node is therefore refused on every node within ``KEYS_REFRESH`` seconds plus one read of the
store. The keys file is imported into the store at start and whenever it changes on disk.

While the store cannot be read the keys last read stay in force (a revoke made meanwhile waits
for the store to be back); the keys file and ``TRIOSHED_API_KEY`` work as ever.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import trio

from trioshed.api.state import AppState
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


async def load(state: AppState) -> bool:
    """Read the store's keys and put them in force on this node now (the gate's ring); False
    when the store cannot be read or the keys are refused (logged)."""
    usage = state.usage
    if usage is None or usage.db is None:
        return False
    try:
        rows = await usage.call(lambda db: db.keys())
    except OSError:
        return False
    usage.stored_keys = tuple(api_key(r) for r in rows if r.revoked is None)
    usage.revoked_keys = frozenset(r.name for r in rows if r.revoked is not None)
    if state.reload_keys is not None:
        try:
            state.reload_keys()
        except ValueError as exc:
            log.error("the store's API keys are not in force: %s", exc)
            return False
    return True


class KeySync:
    """What this node last read of the store's keys, and the keys file's import."""

    def __init__(self, state: AppState, interval: float = KEYS_REFRESH) -> None:
        self.state = state
        self.interval = interval
        self.version = -1
        self.read_at = 0.0
        self._file_seen: tuple[int, int] | None = None

    @property
    def usage(self) -> UsageRecorder | None:
        return self.state.usage

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Import the keys file and read the keys once (before serving), then poll."""
        await self.sync()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.sync()

    async def sync(self) -> bool:
        """Import the keys file when it changed, then read the keys when their version moved;
        True when the keys in force changed. Faults are the recorder's to log."""
        usage = self.usage
        if usage is None or usage.db is None:
            return False
        try:
            await self._import_file(usage)
            version = await usage.call(lambda db: db.keys_version())
        except OSError:
            return False
        self.read_at = time.time()
        if version == self.version:
            return False
        if not await load(self.state):
            return False
        self.version = version
        return True

    async def _import_file(self, usage: UsageRecorder) -> None:
        path = self.state.settings.keys_file
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
