"""Usage in SQLite: per key, model and UTC day (kept), and per hour (the last ``HOURS_KEPT``).

Blocking (sqlite3): called from a worker thread by :mod:`trioshed.usage.recorder`, one call at
a time. WAL journal, ``synchronous=NORMAL``: a committed batch survives the process being
killed. Every fault (locked, read-only, full, corrupt) is a :class:`sqlite3.Error` or an
``OSError`` for the caller to log and retry.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trioshed.usage.ledger import DAY, Spend

HOUR = 3600
HOURS_KEPT = 14 * 24  # hourly rows older than 14 days are removed (the daily rows stay)
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds")

_TABLE = """CREATE TABLE IF NOT EXISTS {name} (
    key TEXT NOT NULL, model TEXT NOT NULL, {unit} INTEGER NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0, seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (key, model, {unit})) WITHOUT ROWID"""
_UPSERT = """INSERT INTO {name} (key, model, {unit}, requests, prompt_tokens, cached_tokens,
    completion_tokens, errors, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (key, model, {unit}) DO UPDATE SET requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    errors = errors + excluded.errors, seconds = seconds + excluded.seconds"""
TABLES = {"hour": ("usage_hour", "hour", HOUR), "day": ("usage_day", "day", int(DAY))}


def aggregate(spends: Iterable[Spend], size: int) -> dict[tuple[str, str, int], list[float]]:
    """Spends summed per (key, model, start of their ``size``-second period)."""
    out: dict[tuple[str, str, int], list[float]] = {}
    for s in spends:
        row = out.setdefault((s.key, s.model, int(s.time // size) * size), [0, 0, 0, 0, 0, 0.0])
        row[0] += 1
        row[1] += s.prompt
        row[2] += s.cached
        row[3] += s.completion
        row[4] += int(s.error)
        row[5] += s.seconds
    return out


class UsageDB:
    def __init__(self, path: Path, *, timeout: float = 0.5) -> None:
        self.path = path
        self.timeout = timeout
        self._db: sqlite3.Connection | None = None
        self._pruned = 0  # the hour last pruned: old hourly rows go once an hour, not per batch

    def open(self) -> None:
        """Open (creating the file and its folder) and check it; sqlite3.Error when it is unusable."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            for name, unit, _ in TABLES.values():
                db.execute(_TABLE.format(name=name, unit=unit))
            db.execute("SELECT count(*) FROM usage_day").fetchone()
        except BaseException:
            db.close()
            raise
        self._db = db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def write(self, spends: list[Spend], now: float) -> None:
        """Add ``spends`` in one transaction (all or nothing)."""
        if self._db is None:
            self.open()
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            for name, unit, size in TABLES.values():
                rows = [(*k, *v) for k, v in aggregate(spends, size).items()]
                db.executemany(_UPSERT.format(name=name, unit=unit), rows)
            if int(now) // HOUR != self._pruned:
                db.execute("DELETE FROM usage_hour WHERE hour < ?", (int(now) - HOURS_KEPT * HOUR,))
            db.execute("COMMIT")
            self._pruned = int(now) // HOUR
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def query(
        self,
        *,
        by: str = "day",
        key: str | None = None,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> list[dict[str, Any]]:
        """Rows per (key, model, period), oldest first; ``since`` inclusive, ``until`` exclusive."""
        if self._db is None:
            self.open()
        assert self._db is not None
        name, unit, _ = TABLES[by]
        where: list[str] = []
        args: list[object] = []
        for column, value in (("key", key), ("model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if since is not None:
            where.append(f"{unit} >= ?")
            args.append(int(since // TABLES[by][2]) * TABLES[by][2])
        if until is not None:
            where.append(f"{unit} < ?")
            args.append(int(until))
        sql = f"SELECT key, model, {unit}, {', '.join(COLUMNS)} FROM {name}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {unit}, key, model"
        return [
            {"key": r[0], "model": r[1], "start": r[2], **dict(zip(COLUMNS, r[3:], strict=True))}
            for r in self._db.execute(sql, args)
        ]

    def today(self, now: float) -> list[tuple[str, int, int]]:
        """(key, prompt, completion) spent today (UTC): the budgets' ledger starts from it."""
        if self._db is None:
            self.open()
        assert self._db is not None
        day = int(now // DAY) * int(DAY)
        rows = self._db.execute(
            "SELECT key, sum(prompt_tokens), sum(completion_tokens) FROM usage_day WHERE day = ? GROUP BY key", (day,)
        )
        return [(k, int(p), int(c)) for k, p, c in rows]
