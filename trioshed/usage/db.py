"""The store in SQLite (the default: one box): usage per key, model, node and UTC day (kept),
and per hour (the last ``HOURS_KEPT``); the keys managed over the API. See
:mod:`trioshed.usage.sqlstore` for the SQL and :mod:`trioshed.usage.schema` for the versions.

Blocking (sqlite3): called from a worker thread by :mod:`trioshed.usage.recorder`, one call at
a time. The file holds the digests of the API keys: it is created readable by its owner only
(0600; SQLite gives its journal files the same), and an older one found wider is narrowed. WAL journal, ``synchronous=NORMAL``: a committed batch survives the process being
killed. Every fault (locked, read-only, full, corrupt) is a :class:`sqlite3.Error` or an
``OSError`` for the caller to log and retry.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trioshed.usage.sqlstore import COLUMNS, HOUR, HOURS_KEPT, TABLES, SqlStore, aggregate

__all__ = ["COLUMNS", "HOUR", "HOURS_KEPT", "TABLES", "UsageDB", "aggregate"]


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def run(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self.db.execute(sql, args).fetchall()

    def many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            self.db.executemany(sql, rows)

    def count(self, sql: str, args: Sequence[object] = ()) -> int:
        return self.db.execute(sql, args).rowcount


def private(path: Path) -> None:
    """Create ``path`` readable and writable by its owner only, or narrow it (and its journal
    files) to that when it exists wider (not when another user owns it: it is used as it is)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if name.stat().st_mode & 0o077:
                name.chmod(0o600)
        except (FileNotFoundError, PermissionError):
            continue


class UsageDB(SqlStore):
    kind = "sqlite"
    dialect = "sqlite"
    _TABLES_SQL = "SELECT name FROM sqlite_master WHERE type = 'table'"

    def __init__(self, path: Path, *, timeout: float = 0.5) -> None:
        super().__init__()
        self.path = path
        self.where = str(path)
        self.timeout = timeout
        self._db: sqlite3.Connection | None = None

    def open(self) -> None:
        """Open (creating the file and its folder), check it and bring its schema up to date;
        sqlite3.Error when it is unusable."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        private(self.path)
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._db = db
            with self._transaction() as tx:
                self._migrate(tx)
            db.execute("SELECT count(*) FROM usage_day").fetchone()
        except BaseException:
            self._db = None
            db.close()
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def is_open(self) -> bool:
        return self._db is not None

    @contextmanager
    def _transaction(self) -> Iterator[_SqliteTx]:
        if self._db is None:
            self.open()
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            yield _SqliteTx(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
