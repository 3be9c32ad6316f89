"""The SQL both stores speak (:mod:`trioshed.usage.store`'s interface): usage rows per node,
the other nodes' spends, the keys and their version counter, and the migrations at open.

A subclass gives a transaction (:meth:`SqlStore._transaction`, yielding a :class:`Tx`) and the
dialect's few differences; statements are written with ``?`` placeholders.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

from trioshed.usage import schema
from trioshed.usage.ledger import DAY, Spend
from trioshed.usage.store import KeyRow, TeamSpend

HOUR = 3600
MINUTE = 60
HOURS_KEPT = 14 * 24  # hourly rows older than 14 days are removed (the daily rows stay)
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds")
TABLES = {"hour": ("usage_hour", "hour", HOUR), "day": ("usage_day", "day", int(DAY))}
_KEY_COLUMNS = ("name", "digest", "role", "weight", "limits", "models", "source", "created", "updated", "last_used", "revoked")
_UPDATABLE = {"digest", "role", "weight", "limits", "models", "revoked"}
_UPSERT = """INSERT INTO {name} (key, model, node, {unit}, requests, prompt_tokens, cached_tokens,
    completion_tokens, errors, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (key, model, node, {unit}) DO UPDATE SET requests = {name}.requests + excluded.requests,
    prompt_tokens = {name}.prompt_tokens + excluded.prompt_tokens,
    cached_tokens = {name}.cached_tokens + excluded.cached_tokens,
    completion_tokens = {name}.completion_tokens + excluded.completion_tokens,
    errors = {name}.errors + excluded.errors, seconds = {name}.seconds + excluded.seconds"""
_UPSERT_MINUTE = """INSERT INTO usage_minute (key, node, minute, prompt_tokens, completion_tokens)
    VALUES (?, ?, ?, ?, ?) ON CONFLICT (key, node, minute) DO UPDATE SET
    prompt_tokens = usage_minute.prompt_tokens + excluded.prompt_tokens,
    completion_tokens = usage_minute.completion_tokens + excluded.completion_tokens"""
_BUMP = "UPDATE meta SET value = value + 1 WHERE name = 'keys_version'"


class SchemaTooNew(OSError):
    """The database was migrated by a newer trioshed: this one leaves it alone."""


class Tx(Protocol):
    def run(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...
    def many(self, sql: str, rows: list[tuple[Any, ...]]) -> None: ...
    def count(self, sql: str, args: Sequence[object] = ()) -> int: ...


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


def _key_row(r: Sequence[Any]) -> KeyRow:
    d = dict(zip(_KEY_COLUMNS, r, strict=True))
    return KeyRow(**{**d, "limits": json.loads(d["limits"]), "models": tuple(json.loads(d["models"]))})


def _key_values(row: KeyRow) -> tuple[object, ...]:
    return (row.name, row.digest, row.role, row.weight, json.dumps(row.limits, sort_keys=True), json.dumps(list(row.models)),
            row.source, row.created, row.updated, row.last_used, row.revoked)  # fmt: skip


class SqlStore:
    kind = ""
    where = ""
    dialect = ""
    _TABLES_SQL = ""  # the names of this database's tables

    def __init__(self) -> None:
        self._pruned = 0  # the hour last pruned: old hourly rows go once an hour, not per batch

    def _transaction(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def _migrate(self, tx: Tx) -> None:
        """Bring the schema to :data:`schema.VERSION` (the caller holds the transaction, and on
        PostgreSQL a lock, so that nodes starting together migrate once)."""
        tables = {r[0] for r in tx.run(self._TABLES_SQL)}
        version = 0
        if "schema_version" in tables:
            version = int(tx.run("SELECT max(version) FROM schema_version")[0][0] or 0)
        else:
            tx.run("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        if version > schema.VERSION:
            raise SchemaTooNew(f"schema version {version} is newer than this trioshed's ({schema.VERSION}); upgrade trioshed")
        for reached, statements in schema.migrations(self.dialect, version, "usage_day" in tables):
            for sql in statements:
                tx.run(sql)
            tx.run("DELETE FROM schema_version")
            tx.run("INSERT INTO schema_version (version) VALUES (?)", (reached,))

    def version(self) -> int:
        with self._transaction() as tx:
            return int(tx.run("SELECT max(version) FROM schema_version")[0][0])

    # -- usage -------------------------------------------------------------------------------

    def write(self, spends: list[Spend], now: float, node: str = "") -> None:
        """Add ``spends`` of ``node`` in one transaction (all or nothing), and the keys' last use."""
        with self._transaction() as tx:
            for name, unit, size in TABLES.values():
                rows = [(k[0], k[1], node, k[2], *v) for k, v in aggregate(spends, size).items()]
                tx.many(_UPSERT.format(name=name, unit=unit), rows)
            minutes: dict[tuple[str, int], list[int]] = {}
            last: dict[str, float] = {}
            for s in spends:
                if s.prompt or s.completion:
                    m = minutes.setdefault((s.key, int(s.time // MINUTE) * MINUTE), [0, 0])
                    m[0] += s.prompt
                    m[1] += s.completion
                last[s.key] = max(last.get(s.key, 0.0), s.time)
            tx.many(_UPSERT_MINUTE, [(k, node, m, p, c) for (k, m), (p, c) in minutes.items()])
            tx.many(
                "UPDATE api_keys SET last_used = ? WHERE name = ? AND (last_used IS NULL OR last_used < ?)",
                [(t, k, t) for k, t in last.items()],
            )
            if int(now) // HOUR != self._pruned:
                tx.run("DELETE FROM usage_hour WHERE hour < ?", (int(now) - HOURS_KEPT * HOUR,))
                tx.run("DELETE FROM usage_minute WHERE minute < ?", (int(now) - HOUR,))
        self._pruned = int(now) // HOUR

    def query(
        self, *, by: str = "day", key: str | None = None, model: str | None = None, node: str | None = None,
        since: float | None = None, until: float | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Rows per (key, model, node, period), every node's (or ``node``'s), oldest first;
        ``since`` inclusive, ``until`` exclusive. The team's total is the rows' sum."""
        name, unit, size = TABLES[by]
        where: list[str] = []
        args: list[object] = []
        for column, value in (("key", key), ("model", model), ("node", node)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if since is not None:
            where.append(f"{unit} >= ?")
            args.append(int(since // size) * size)
        if until is not None:
            where.append(f"{unit} < ?")
            args.append(int(until))
        sums = ", ".join(f"CAST(sum({c}) AS {'DOUBLE PRECISION' if c == 'seconds' else 'BIGINT'})" for c in COLUMNS)
        sql = f"SELECT key, model, node, {unit}, {sums} FROM {name}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" GROUP BY key, model, node, {unit} ORDER BY {unit}, key, model, node"
        with self._transaction() as tx:
            rows = tx.run(sql, args)
        return [
            {"key": r[0], "model": r[1], "node": r[2], "start": int(r[3]),
             **{c: (float(v) if c == "seconds" else int(v)) for c, v in zip(COLUMNS, r[4:], strict=True)}}
            for r in rows
        ]  # fmt: skip

    def today(self, now: float, node: str | None = None) -> list[tuple[str, int, int]]:
        """(key, prompt, completion) spent today (UTC), by ``node`` (None: every node)."""
        sql = "SELECT key, CAST(sum(prompt_tokens) AS BIGINT), CAST(sum(completion_tokens) AS BIGINT) FROM usage_day WHERE day = ?"
        args: list[object] = [int(now // DAY) * int(DAY)]
        if node is not None:
            sql += " AND node = ?"
            args.append(node)
        with self._transaction() as tx:
            rows = tx.run(sql + " GROUP BY key", args)
        return [(k, int(p), int(c)) for k, p, c in rows]

    def others(self, now: float, node: str) -> list[TeamSpend]:
        """What nodes other than ``node`` spent per key: today, and in the minutes that began at
        most 60 s before ``now`` (whole minutes: 60 to 120 s of their spends)."""
        with self._transaction() as tx:
            days = tx.run(
                "SELECT key, CAST(sum(prompt_tokens) AS BIGINT), CAST(sum(completion_tokens) AS BIGINT) FROM usage_day "
                "WHERE day = ? AND node <> ? GROUP BY key", (int(now // DAY) * int(DAY), node),
            )  # fmt: skip
            minutes = tx.run(
                "SELECT key, CAST(sum(prompt_tokens) AS BIGINT), CAST(sum(completion_tokens) AS BIGINT) FROM usage_minute "
                "WHERE minute >= ? AND node <> ? GROUP BY key", (int((now - MINUTE) // MINUTE) * MINUTE, node),
            )  # fmt: skip
        minute = {k: (int(p), int(c)) for k, p, c in minutes}
        out = [TeamSpend(k, int(p), int(c), *minute.pop(k, (0, 0))) for k, p, c in days]
        return out + [TeamSpend(k, 0, 0, p, c) for k, (p, c) in minute.items()]

    # -- keys --------------------------------------------------------------------------------

    def keys_version(self) -> int:
        with self._transaction() as tx:
            return int(tx.run("SELECT value FROM meta WHERE name = 'keys_version'")[0][0])

    def keys(self) -> list[KeyRow]:
        """Every key, revoked ones too, by name."""
        with self._transaction() as tx:
            return [_key_row(r) for r in tx.run(f"SELECT {', '.join(_KEY_COLUMNS)} FROM api_keys ORDER BY name")]

    def create_key(self, row: KeyRow) -> bool:
        """Add a key (or replace a revoked one of that name); False when the name is taken."""
        marks = ", ".join("?" * len(_KEY_COLUMNS))
        sets = ", ".join(f"{c} = excluded.{c}" for c in _KEY_COLUMNS[1:])
        with self._transaction() as tx:
            n = tx.count(
                f"INSERT INTO api_keys ({', '.join(_KEY_COLUMNS)}) VALUES ({marks}) "
                f"ON CONFLICT (name) DO UPDATE SET {sets} WHERE api_keys.revoked IS NOT NULL", _key_values(row),
            )  # fmt: skip
            if n:
                tx.run(_BUMP)
        return bool(n)

    def update_key(self, name: str, changes: dict[str, Any], now: float) -> bool:
        """Change a key that is not revoked (``revoked`` set: revoke it); False when there is none."""
        assert set(changes) <= _UPDATABLE, changes
        values = {**changes, "updated": now, "source": "api"}  # managed over the API from now on: the file's import leaves it
        if "limits" in values:
            values["limits"] = json.dumps(values["limits"], sort_keys=True)
        if "models" in values:
            values["models"] = json.dumps(list(values["models"]))
        sets = ", ".join(f"{c} = ?" for c in values)
        with self._transaction() as tx:
            n = tx.count(f"UPDATE api_keys SET {sets} WHERE name = ? AND revoked IS NULL", (*values.values(), name))
            if n:
                tx.run(_BUMP)
        return bool(n)

    def patch_key(self, name: str, changes: dict[str, Any], now: float) -> KeyRow | None:
        """Change some fields of a key that is not revoked, in one transaction (two changes of
        different fields made at once both hold): ``limits`` are merged into the key's (a limit
        of 0 removes it). The key as changed; None when there is none."""
        assert set(changes) <= _UPDATABLE - {"revoked"}, changes
        lock = " FOR UPDATE" if self.dialect == "postgresql" else ""  # SQLite's BEGIN IMMEDIATE holds the file
        with self._transaction() as tx:
            found = tx.run(f"SELECT {', '.join(_KEY_COLUMNS)} FROM api_keys WHERE name = ? AND revoked IS NULL{lock}", (name,))
            if not found:
                return None
            old = _key_row(found[0])
            values = dict(changes)
            if "limits" in values:
                values["limits"] = {f: v for f, v in {**old.limits, **values["limits"]}.items() if v}
            new = replace(old, **values, updated=now, source="api")
            sets = ", ".join(f"{c} = ?" for c in _KEY_COLUMNS[1:])
            tx.run(f"UPDATE api_keys SET {sets} WHERE name = ?", (*_key_values(new)[1:], name))
            tx.run(_BUMP)
        return new

    def import_keys(self, rows: Sequence[KeyRow], now: float, node: str = "", conflicts: list[str] | None = None) -> int:
        """The keys file of node ``node`` into the store: new names are added as that node's,
        keys it imported before follow its file; a key made or revoked over the API is left
        alone, and so is a name another node's file gave (its name goes to ``conflicts``, when its
        secret or rights differ: two files never overwrite each other). The number changed."""
        changed = 0
        mine = ("file", f"file@{node}") if node else ("file",)
        same = ("digest", "role", "weight", "limits", "models")
        with self._transaction() as tx:
            known = {r.name: r for r in (_key_row(x) for x in tx.run(f"SELECT {', '.join(_KEY_COLUMNS)} FROM api_keys"))}
            for row in rows:
                row = replace(row, source=mine[-1])
                old = known.get(row.name)
                differs = old is not None and any(getattr(old, f) != getattr(row, f) for f in same)
                if old is None:
                    marks = ", ".join("?" * len(_KEY_COLUMNS))
                    tx.run(f"INSERT INTO api_keys ({', '.join(_KEY_COLUMNS)}) VALUES ({marks})", _key_values(row))
                elif old.source in mine and old.revoked is None and (differs or old.source != row.source):
                    tx.run(
                        "UPDATE api_keys SET digest = ?, role = ?, weight = ?, limits = ?, models = ?, source = ?, updated = ? "
                        "WHERE name = ?", (*_key_values(row)[1:7], now, row.name),
                    )  # fmt: skip
                else:
                    if differs and old is not None and old.source.startswith("file") and conflicts is not None:
                        conflicts.append(row.name)
                    continue
                changed += 1
            if changed:
                tx.run(_BUMP)
        return changed

