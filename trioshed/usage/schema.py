"""The shared store's schema and its migrations, for SQLite and PostgreSQL alike.

One schema, versioned: ``schema_version`` holds the version a database is at, and
:func:`migrations` lists the statements that take it from each version to the next. They run at
start, in one transaction (SQLite and PostgreSQL both roll DDL back), so a database is at one
version or the next, never between. A SQLite file from before versions (usage tables, no
``schema_version``) is version 1: its rows are carried into the version-2 tables, node ``""``.

Version 2: usage rows carry the node that served them (``node``); ``usage_minute`` (tokens per
key, node and minute, kept an hour) lets every node see the team's last minute for budgets;
``api_keys`` (hashed secrets, limits, revocations) and ``meta`` (``keys_version``, bumped by each
change of a key, which nodes poll) hold the keys managed over the API.

Version 3: ``fleet_nodes`` (PostgreSQL only: a SQLite file serves one box) holds each node's
fleet state, the URL the other nodes reach it at, and when it was written by the database's
clock (:mod:`trioshed.fleet.dbpeers`).
"""

from __future__ import annotations

VERSION = 3

_COUNTS = """requests BIGINT NOT NULL DEFAULT 0, prompt_tokens BIGINT NOT NULL DEFAULT 0,
    cached_tokens BIGINT NOT NULL DEFAULT 0, completion_tokens BIGINT NOT NULL DEFAULT 0,
    errors BIGINT NOT NULL DEFAULT 0, seconds DOUBLE PRECISION NOT NULL DEFAULT 0"""
_COLUMNS = "requests, prompt_tokens, cached_tokens, completion_tokens, errors, seconds"

#: Version 1: the usage tables as they were before the store had versions (SQLite only).
_V1 = [
    f"CREATE TABLE IF NOT EXISTS usage_{unit} (key TEXT NOT NULL, model TEXT NOT NULL, {unit} INTEGER NOT NULL, "
    f"{_COUNTS}, PRIMARY KEY (key, model, {unit})) WITHOUT ROWID"
    for unit in ("hour", "day")
]


def _v2(dialect: str, carry: bool) -> list[str]:
    rowid = " WITHOUT ROWID" if dialect == "sqlite" else ""
    out: list[str] = []
    for unit in ("hour", "day"):
        target = f"usage_{unit}_v2" if carry else f"usage_{unit}"
        out.append(
            f"CREATE TABLE {target} (key TEXT NOT NULL, model TEXT NOT NULL, node TEXT NOT NULL DEFAULT '', "
            f"{unit} BIGINT NOT NULL, {_COUNTS}, PRIMARY KEY (key, model, node, {unit})){rowid}"
        )
        if carry:  # the rows of before, node "" (whichever node it was: one box had one)
            out += [
                f"INSERT INTO {target} (key, model, node, {unit}, {_COLUMNS}) "
                f"SELECT key, model, '', {unit}, {_COLUMNS} FROM usage_{unit}",
                f"DROP TABLE usage_{unit}",
                f"ALTER TABLE {target} RENAME TO usage_{unit}",
            ]
    out += [
        "CREATE TABLE usage_minute (key TEXT NOT NULL, node TEXT NOT NULL, minute BIGINT NOT NULL, "
        f"prompt_tokens BIGINT NOT NULL DEFAULT 0, completion_tokens BIGINT NOT NULL DEFAULT 0, "
        f"PRIMARY KEY (key, node, minute)){rowid}",
        "CREATE TABLE api_keys (name TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, role TEXT NOT NULL, "
        "weight DOUBLE PRECISION NOT NULL, limits TEXT NOT NULL, models TEXT NOT NULL, source TEXT NOT NULL, "
        "created DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL, last_used DOUBLE PRECISION, "
        "revoked DOUBLE PRECISION)",
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO meta (name, value) VALUES ('keys_version', 0)",
    ]
    return out


#: Version 3: the fleet's nodes, one row each, written by the node itself every interval.
_V3 = [
    "CREATE TABLE fleet_nodes (name TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, "
    "updated TIMESTAMP WITH TIME ZONE NOT NULL)",
]


def migrations(dialect: str, version: int, has_usage: bool) -> list[tuple[int, list[str]]]:
    """(version reached, its statements) for each step from ``version`` (0: a new database) up
    to :data:`VERSION`. ``has_usage``: an unversioned SQLite file that already has usage tables."""
    steps: list[tuple[int, list[str]]] = []
    if version < 1:
        steps.append((1, _V1 if dialect == "sqlite" else []))
        has_usage = has_usage or dialect == "sqlite"
    if version < 2:
        steps.append((2, _v2(dialect, carry=has_usage)))
    if version < 3:
        steps.append((3, _V3 if dialect == "postgresql" else []))
    return steps
