"""The store in PostgreSQL (a team of nodes: ``TRIOSHED_DATABASE=postgresql://...``), with
psycopg 3 and its connection pool. Same SQL as SQLite (:mod:`trioshed.usage.sqlstore`).

Blocking: called from worker threads. Connecting waits at most ``connect_timeout`` seconds, so
a database that is down costs the caller a bounded wait and a
:class:`~trioshed.usage.store.StoreUnavailable`; the pool
opens its connections again once the database is back. The URL's password never leaves this
module: :attr:`PgStore.where` and every message are redacted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from trioshed.usage.sqlstore import SqlStore
from trioshed.usage.store import StoreUnavailable, redact

_MIGRATION_LOCK = 0x74726F  # pg_advisory_xact_lock: nodes starting together migrate one at a time


class _PgTx:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(sql.replace("?", "%s"), tuple(args))  # type: ignore[call-overload]
        return cur.fetchall() if cur.description is not None else []

    def many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            with self.conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)  # type: ignore[call-overload]

    def count(self, sql: str, args: Sequence[object] = ()) -> int:
        return self.conn.execute(sql.replace("?", "%s"), tuple(args)).rowcount  # type: ignore[call-overload]


class PgStore(SqlStore):
    kind = "postgresql"
    dialect = "postgresql"
    _TABLES_SQL = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"

    def __init__(self, url: str, *, connect_timeout: float = 2.0, max_size: int = 4) -> None:
        super().__init__()
        self._url = url
        self.where = redact(url)
        self.connect_timeout = connect_timeout
        self.max_size = max_size
        self._pool: ConnectionPool[Any] | None = None
        self._migrated = False

    def open(self) -> None:
        """Open the pool and migrate; StoreUnavailable (redacted) when the database cannot be used."""
        if self._pool is None:
            self._pool = ConnectionPool(
                self._url, min_size=1, max_size=self.max_size, open=False, timeout=self.connect_timeout,
                kwargs={"connect_timeout": max(1, int(self.connect_timeout)), "application_name": "trioshed"},
                check=ConnectionPool.check_connection, name="trioshed",  # a restart's dead connections are not handed out
            )  # fmt: skip
            self._pool.open(wait=False)
        if not self._migrated:
            with self._transaction(migrating=True) as tx:
                tx.run("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
                self._migrate(tx)
            self._migrated = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close(timeout=self.connect_timeout)
            self._pool = None
            self._migrated = False

    @property
    def is_open(self) -> bool:
        return self._pool is not None and self._migrated

    # -- the fleet's nodes (trioshed.fleet.dbpeers) -------------------------------------------

    def exchange(self, me: str, mine: tuple[str, str] | None, forget_after: float) -> list[tuple[str, str, str, float]]:
        """Read every node's row as (name, URL, state, age in seconds by the database's clock),
        ``me``'s own as it was before this call, then write ``me``'s (``mine``: its URL and state
        as JSON; None: write nothing), in one transaction; rows not written for ``forget_after``
        seconds are removed first."""
        with self._transaction() as tx:
            tx.run("DELETE FROM fleet_nodes WHERE updated < clock_timestamp() - make_interval(secs => ?)", (float(forget_after),))
            rows = tx.run(
                "SELECT name, url, state, CAST(EXTRACT(EPOCH FROM clock_timestamp() - updated) AS DOUBLE PRECISION) "
                "FROM fleet_nodes ORDER BY name",
            )  # fmt: skip
            if mine is not None:
                tx.run(
                    "INSERT INTO fleet_nodes (name, url, state, updated) VALUES (?, ?, ?, clock_timestamp()) "
                    "ON CONFLICT (name) DO UPDATE SET url = excluded.url, state = excluded.state, updated = excluded.updated",
                    (me, *mine),
                )  # fmt: skip
        return [(str(n), str(u), str(s), max(0.0, float(a))) for n, u, s, a in rows]

    def withdraw(self, me: str) -> None:
        """Remove node ``me``'s row (a clean stop)."""
        with self._transaction() as tx:
            tx.run("DELETE FROM fleet_nodes WHERE name = ?", (me,))

    @contextmanager
    def _transaction(self, migrating: bool = False) -> Iterator[_PgTx]:
        if not migrating and not self.is_open:
            self.open()
        assert self._pool is not None
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield _PgTx(conn)
        except PoolTimeout:
            raise StoreUnavailable(f"no connection to {self.where} within {self.connect_timeout:g} s") from None
        except psycopg.Error as exc:
            raise StoreUnavailable(redact(str(exc))) from None
