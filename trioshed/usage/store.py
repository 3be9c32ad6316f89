"""The shared store: usage rows, the team's spends for budgets, and the keys managed over the
API, behind one small interface with two implementations: SQLite (the default, one box:
:mod:`trioshed.usage.db`) and PostgreSQL (a team of nodes: :mod:`trioshed.usage.pg`), chosen by
``TRIOSHED_DATABASE``. Both speak the SQL of :mod:`trioshed.usage.sqlstore`.

Every method blocks (a driver call): ``serve()``'s tasks call them from a worker thread, one at a
time (:mod:`trioshed.usage.recorder` holds the lock). Every fault is a :data:`StoreError`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trioshed.core.dburl import redact
from trioshed.usage.ledger import Spend

__all__ = ["KeyRow", "Store", "StoreError", "StoreUnavailable", "TeamSpend", "redact"]

#: What a store raises when it cannot be used (the caller logs it and tries again later).
class StoreUnavailable(Exception):
    """A fault of the team's PostgreSQL (raised by :mod:`trioshed.usage.pg`, its message without
    the password): its own class, so that a server without a database never imports psycopg."""


StoreError = (sqlite3.Error, StoreUnavailable, OSError)

@dataclass(frozen=True)
class KeyRow:
    """An API key as the store keeps it: the secret only as its digest (:func:`trioshed.keys.digest`)."""

    name: str
    digest: str = field(repr=False)
    role: str = "user"
    weight: float = 1.0
    limits: dict[str, int] = field(default_factory=dict)  # max_concurrent, ..., tokens_per_day: non-zero ones
    models: tuple[str, ...] = ()
    source: str = "api"  # "api", or "file@<node>": imported from that node's keys file ("file": before nodes were named)
    created: float = 0.0
    updated: float = 0.0
    last_used: float | None = None
    revoked: float | None = None


@dataclass(frozen=True)
class TeamSpend:
    """What the *other* nodes spent of one key: today (UTC) and in the last minute."""

    key: str
    day_prompt: int
    day_completion: int
    minute_prompt: int
    minute_completion: int


class Store(Protocol):
    kind: str  # "sqlite" or "postgresql"
    where: str  # the file, or the URL without its password: for logs

    @property
    def is_open(self) -> bool: ...
    def open(self) -> None: ...
    def close(self) -> None: ...

    def write(self, spends: list[Spend], now: float, node: str = "") -> None: ...
    def query(
        self, *, by: str = "day", key: str | None = None, model: str | None = None, node: str | None = None,
        since: float | None = None, until: float | None = None,
    ) -> list[dict[str, Any]]: ...  # fmt: skip
    def today(self, now: float, node: str | None = None) -> list[tuple[str, int, int]]: ...
    def others(self, now: float, node: str) -> list[TeamSpend]: ...

    def keys_version(self) -> int: ...
    def keys(self) -> list[KeyRow]: ...
    def create_key(self, row: KeyRow) -> bool: ...
    def update_key(self, name: str, changes: dict[str, Any], now: float) -> bool: ...
    def patch_key(self, name: str, changes: dict[str, Any], now: float) -> KeyRow | None: ...
    def import_keys(self, rows: Sequence[KeyRow], now: float, node: str = "", conflicts: list[str] | None = None) -> int: ...
