"""The keys of the shared store, kept in force on this node: ``serve()`` runs
:meth:`KeySync.run`, which every ``KEYS_REFRESH`` seconds reads the store's key-version counter
and, when it moved, the keys (revoked ones too), then calls ``reload`` (the gate rebuilding its
ring from the keys file, ``TRIOSHED_API_KEY`` and :attr:`KeySync.stored` less
:attr:`KeySync.revoked`). A key revoked on any node is therefore refused on every node within
``KEYS_REFRESH`` seconds plus one read of the store. The keys file is imported into the store at
start and whenever it changes on disk.

**A new key works on every node at once.** A credential (or a forwarded key's name) this node
does not know is not refused before the store was asked: :meth:`KeySync.look_again` reads the
keys' version in a reading that begins after the request arrived (so a key made on another node
before the request was sent is found), and the keys when it moved. Readings for unknown keys are
at most one per :data:`LOOK_AGAIN` seconds, shared by every request waiting for one, and a
credential found unknown is answered at once for :data:`MISS_TTL` seconds: a flood of wrong keys
costs the store at most one small reading per interval, whatever their number.

**While a shared store cannot be read** the keys last read stay in force for
``TRIOSHED_KEYS_STALE`` seconds (30); after that, a key this node honours only on the store's word
(made or changed over the API: :attr:`~trioshed.keys.ApiKey.stored`) is refused (503) until the
store answers again, since a revoke made meanwhile on another node cannot be seen here. The keys
file and ``TRIOSHED_API_KEY`` work as ever. A SQLite store is this server's own: its keys change
only through this server, so they never go stale.

**A keys file's keys are its node's.** Imported into a shared store, a key belongs to the node
whose file gave it first: another node's file naming the same key with another secret or other
rights does not replace it (logged once per name); every node honours the store's copy.

This module knows the recorder (whose worker thread and lock every store call goes through) and
the keys, never the HTTP edge: ``serve()`` passes the gate's rebuild in as ``reload``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from trioshed.errors import TrioshedError
from trioshed.keys import LIMIT_FIELDS, RESERVED, ApiKey, digest, load_keys_file
from trioshed.usage.recorder import UsageRecorder
from trioshed.usage.store import KeyRow

log = logging.getLogger(__name__)

KEYS_REFRESH = 2.0  # seconds between two reads of the key-version counter
LOOK_AGAIN = 0.05  # seconds between two readings of the store for keys this node does not know
MISS_TTL = 1.0  # seconds a credential found unknown is refused without asking the store again
_MISSES = 4096  # credentials remembered as unknown, at most


class KeysStale(TrioshedError):
    """A key honoured only on the shared store's word, while the store has not been read for
    ``TRIOSHED_KEYS_STALE`` seconds."""

    status = 503

    def __init__(self, key: str, age: float) -> None:
        super().__init__(
            f"API key '{key}' was made over the API and the key store has not been read for {age:.0f} s: it is refused "
            "until the store answers again (it may have been revoked meanwhile; TRIOSHED_KEYS_STALE)",
            headers={"Retry-After": "5"},
        )


def api_key(row: KeyRow) -> ApiKey:
    """The key a row of the store stands for (no secret: its digest; honoured on the store's word)."""
    limits = {f: int(v) for f, v in row.limits.items() if f in LIMIT_FIELDS}
    return ApiKey(row.name, "", float(row.weight), role=row.role, models=tuple(row.models), digest=row.digest, stored=True, **limits)  # type: ignore[arg-type]


def key_row(key: ApiKey, digest: str, now: float, source: str = "api") -> KeyRow:
    """The row to store for ``key`` (limits that are 0 are left out)."""
    limits = {f: getattr(key, f) for f in LIMIT_FIELDS if getattr(key, f)}
    return KeyRow(key.name, digest, key.role, key.weight, limits, key.models, source, now, now)


class KeySync:
    """What this node last read of the store's keys (:attr:`stored`, :attr:`revoked`), and the
    keys file's import. ``reload`` puts them in force (ValueError: refused, logged)."""

    def __init__(
        self, usage: UsageRecorder, keys_file: Path | None, reload: Callable[[], object], interval: float = KEYS_REFRESH,
        *, stale_after: float = 30.0,
    ) -> None:  # fmt: skip
        self.usage = usage
        self.keys_file = keys_file
        self.reload = reload
        self.interval = interval
        self.stale_after = stale_after
        self.version = -1
        self.read_at = 0.0
        self._read_mono = time.monotonic()  # the last reading of the store (its start, before any)
        self.changes = 0  # how many times the keys in force changed
        self._lookups_started = 0
        self._lookups_done = 0
        self._lookup_at = -math.inf
        self._lookup_lock = trio.Lock()
        self._misses: dict[str, float] = {}  # credential -> until when it is known unknown
        self._conflicts: set[str] = set()  # names another node's keys file holds (logged once)
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
        self._read_mono = time.monotonic()
        self.stored = tuple(api_key(r) for r in rows if r.revoked is None and r.name != RESERVED)
        self.revoked = frozenset(r.name for r in rows if r.revoked is not None and r.name != RESERVED)
        try:
            self.reload()
        except ValueError as exc:
            log.error("the store's API keys are not in force: %s", exc)
            return False
        self.changes += 1
        self._misses.clear()
        return True

    @property
    def lookups(self) -> int:
        """Readings of the store made for keys this node did not know."""
        return self._lookups_started

    def check_fresh(self, key: ApiKey) -> None:
        """KeysStale when ``key`` is honoured only on a shared store's word and that store was not
        read for ``stale_after`` seconds (see the module docstring)."""
        if not key.stored or self.usage.db is None or self.usage.db.kind != "postgresql":
            return
        age = time.monotonic() - self._read_mono
        if age > self.stale_after:
            raise KeysStale(key.name, age)

    async def look_again(self, credential: str) -> bool:
        """Whether the keys in force changed in a reading of the store that began after this
        call (then the caller asks its keys again); False at once for a ``credential`` (a
        secret's digest, or ``"name:<key name>"``) found unknown within :data:`MISS_TTL`. See
        the module docstring."""
        if self.usage.db is None:
            return False
        now = trio.current_time()
        if self._misses.get(credential, -math.inf) > now:
            return False
        needed, before = self._lookups_started + 1, self.changes
        async with self._lookup_lock:
            if self._lookups_done < needed:  # no reading began after this call yet: this one
                await trio.sleep_until(self._lookup_at + LOOK_AGAIN)
                self._lookups_started += 1
                self._lookup_at = trio.current_time()
                try:
                    await self.sync()
                finally:
                    self._lookups_done = self._lookups_started
        if self.changes != before:
            return True
        if len(self._misses) >= _MISSES:
            for old in list(self._misses)[: _MISSES // 2]:
                del self._misses[old]
        self._misses[credential] = trio.current_time() + MISS_TTL
        return False

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
        self._read_mono = time.monotonic()
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
        conflicts: list[str] = []
        changed = await usage.call(lambda db: db.import_keys(rows, now, usage.node, conflicts))
        self._file_seen = seen
        if changed:
            log.info("keys file %s: %d key(s) imported into the store %s", path, changed, usage.where)
        for name in set(conflicts) - self._conflicts:
            log.error(
                "keys file %s: key %r is another node's in the store %s, with another secret or other rights: this node "
                "honours the store's copy; give the key another name, or the same secret and rights on every node",
                path, name, usage.where,
            )  # fmt: skip
        self._conflicts = set(conflicts)
