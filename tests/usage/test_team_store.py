"""The shared store: SQLite and a real PostgreSQL behind one interface (the same tests on both),
the SQLite file's migration from before versions, and the URL's password never shown.

PostgreSQL is Debian's (``initdb``/``pg_ctl``, started in a temporary folder by
:mod:`trioshed.testing.postgres`). Where it is not installed these tests are skipped, except
under ``.ci/run`` (``TRIOSHED_TEST_NEEDS_POSTGRES`` set), where they fail: ``.ci/run`` installs it.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.postgres import fresh_database, needs_postgres, postgres  # noqa: F401
from trioshed.config import Settings
from trioshed.testing.postgres import PASSWORD, Postgres
from trioshed.testing.server import open_test_server
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import DAY, Spend
from trioshed.usage.pg import PgStore
from trioshed.usage.recorder import UsageRecorder
from trioshed.usage.schema import VERSION
from trioshed.usage.sqlstore import SqlStore
from trioshed.usage.store import KeyRow, redact


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=needs_postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    s: SqlStore = UsageDB(tmp_path / "usage.db") if request.param == "sqlite" else PgStore(fresh_database(request.getfixturevalue("postgres")))
    s.open()
    yield s
    s.close()


def spends(n: int, key: str = "ann", when: float = 20 * DAY + 3600.5) -> list[Spend]:
    return [Spend(key, "tiny:latest", when + i, prompt=10, cached=4, completion=5, error=i == 0, seconds=0.25) for i in range(n)]


def test_usage_rows_are_per_node_and_the_team_is_every_nodes(store: SqlStore) -> None:
    assert store.version() == VERSION
    store.write(spends(3), 20 * DAY + 4000, "a")
    store.write(spends(2), 20 * DAY + 4000, "b")
    store.write(spends(1), 20 * DAY + 4000, "a")  # added to a's row
    a, b = store.query(by="day", key="ann")
    assert a == {"key": "ann", "model": "tiny:latest", "node": "a", "start": 20 * DAY, "requests": 4, "prompt_tokens": 40,
                 "cached_tokens": 16, "completion_tokens": 20, "errors": 2, "seconds": 1.0}  # fmt: skip
    assert (b["node"], b["requests"], b["prompt_tokens"], b["errors"]) == ("b", 2, 20, 1)
    assert [(r["node"], r["requests"]) for r in store.query(node="b")] == [("b", 2)]
    assert [(r["node"], r["requests"]) for r in store.query(by="hour", key="ann")] == [("a", 4), ("b", 2)]
    assert store.query(key="bob") == []
    assert store.today(20 * DAY + 5000) == [("ann", 60, 30)]  # budgets: every node's
    assert store.today(20 * DAY + 5000, "a") == [("ann", 40, 20)]
    (other,) = store.others(20 * DAY + 3610, "a")  # what b spent, seen from a
    assert (other.key, other.day_prompt, other.day_completion, other.minute_prompt, other.minute_completion) == ("ann", 20, 10, 20, 10)
    assert store.others(20 * DAY + 3800, "a")[0].minute_prompt == 0  # minutes ago: out of the minute


def test_keys_are_created_listed_updated_revoked_and_imported(store: SqlStore) -> None:
    v0 = store.keys_version()
    assert store.create_key(KeyRow("ann", "d-ann", limits={"tokens_per_day": 100}, created=1.0, updated=1.0))
    assert not store.create_key(KeyRow("ann", "d-other"))  # the name is taken
    assert store.keys_version() == v0 + 1
    assert store.update_key("ann", {"limits": {"tokens_per_day": 5}, "role": "admin"}, 2.0)
    (ann,) = store.keys()
    assert (ann.limits, ann.role, ann.digest, ann.revoked) == ({"tokens_per_day": 5}, "admin", "d-ann", None)
    store.write([Spend("ann", "m", 77.0, prompt=1)], 80.0, "a")
    assert store.keys()[0].last_used == 77.0
    assert store.update_key("ann", {"revoked": 3.0}, 3.0)
    assert not store.update_key("ann", {"role": "user"}, 4.0)  # revoked: nothing to change
    # the keys file: new names added; a name revoked over the API stays revoked
    assert store.import_keys([KeyRow("bob", "d-bob", source="file"), KeyRow("ann", "d-file", source="file")], 5.0) == 1
    assert store.import_keys([KeyRow("bob", "d-bob", source="file")], 6.0) == 0  # unchanged: no new version
    assert store.import_keys([KeyRow("bob", "d-bob2", source="file")], 7.0) == 1  # the file changed bob's secret
    rows = {r.name: r for r in store.keys()}
    assert rows["ann"].revoked == 3.0 and rows["ann"].digest == "d-ann" and rows["bob"].digest == "d-bob2"
    assert store.create_key(KeyRow("ann", "d-ann2"))  # a revoked name may be made again


V1_TABLE = """CREATE TABLE usage_{unit} (key TEXT NOT NULL, model TEXT NOT NULL, {unit} INTEGER NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0, seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (key, model, {unit})) WITHOUT ROWID"""


def test_a_sqlite_file_from_before_versions_is_upgraded_in_place_keeping_every_row(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    with closing(sqlite3.connect(path)) as old:  # what trioshed wrote before the store had versions
        for unit in ("hour", "day"):
            old.execute(V1_TABLE.format(unit=unit))
        old.executemany("INSERT INTO usage_day VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [("ann", "tiny", 20 * DAY, 3, 30, 12, 15, 1, 0.75), ("bob", "tiny", 19 * DAY, 1, 5, 0, 2, 0, 0.1)])  # fmt: skip
        old.execute("INSERT INTO usage_hour VALUES ('ann', 'tiny', ?, 3, 30, 12, 15, 1, 0.75)", (20 * DAY + 3600,))
        old.commit()
    db = UsageDB(path)
    db.open()
    assert db.version() == VERSION
    assert [(r["key"], r["start"], r["requests"], r["prompt_tokens"]) for r in db.query()] == [("bob", 19 * DAY, 1, 5), ("ann", 20 * DAY, 3, 30)]
    assert db.query(by="hour")[0]["completion_tokens"] == 15
    db.write([Spend("ann", "tiny", 20 * DAY + 10, prompt=1)], 20 * DAY + 20, "gpu-1")  # new rows beside the old ones
    assert [(r["node"], r["requests"]) for r in db.query(key="ann", by="day")] == [("", 3), ("gpu-1", 1)]
    db.close()
    again = UsageDB(path)  # opened again: nothing more to migrate, nothing lost
    again.open()
    assert again.version() == VERSION and sum(r["requests"] for r in again.query(key="ann")) == 4
    again.close()
    with closing(sqlite3.connect(path)) as check:
        assert check.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)


def test_the_url_password_is_never_shown() -> None:
    url = "postgresql://trioshed:hunter2-secret@db.example:5432/team?sslmode=require&password=other-secret"
    assert redact(url) == "postgresql://trioshed:***@db.example:5432/team?sslmode=require&password=***"
    with pytest.raises(ValueError) as exc:
        Settings.from_env({"TRIOSHED_DATABASE": "mysql://root:hunter2-secret@db/x"})
    assert "hunter2" not in str(exc.value) and "***" in str(exc.value)
    assert PgStore(url).where == redact(url)


@needs_postgres
async def test_an_unreachable_database_is_said_without_its_password(
    postgres: Postgres, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level(logging.INFO)
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/postgres"  # nothing listens there
    recorder = UsageRecorder(PgStore(url, connect_timeout=1), node="a")
    recorder.record(Spend("ann", "m", 1.0, prompt=1))
    await recorder.flush()
    assert recorder.problem == "is unreachable" and len(recorder.pending) == 1
    assert PASSWORD not in caplog.text and "postgres:***@127.0.0.1:1" in caplog.text
    with pytest.raises(OSError) as exc:
        await recorder.query()
    assert PASSWORD not in str(exc.value)
    assert recorder.db is not None
    recorder.db.close()


async def test_keys_over_the_api_on_one_box_and_never_on_a_server_without_keys(tmp_path: Path) -> None:
    """SQLite (one box) serves the keys routes as PostgreSQL does; a server without API keys
    refuses to make one (it would lock its clients out; anyone reaching it could)."""
    models = tmp_path / "models"
    models.mkdir()
    boss = {"Authorization": "Bearer boss-secret-1"}
    with trio.fail_after(60):
        async with open_test_server(models, usage_db=tmp_path / "usage.db") as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                for method, path in (("POST", "/api/keys"), ("GET", "/api/keys"), ("DELETE", "/api/keys/ann"), ("POST", "/api/keys/ann/rotate")):
                    r = await http.request(method, path, json={"name": "ann"})
                    assert r.status_code == 403 and "TRIOSHED_API_KEY" in r.json()["error"], (method, path, r.text)
                assert (await http.get("/api/tags")).status_code == 200  # still keyless: nothing was made
        async with open_test_server(models, usage_db=tmp_path / "usage.db", api_key="boss-secret-1") as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                made = await http.post("/api/keys", headers=boss, json={"name": "ann", "tokens_per_day": 10})
                assert made.status_code == 201 and made.json()["tokens_per_day"] == 10
                ann = {"Authorization": f"Bearer {made.json()['key']}"}
                assert (await http.get("/api/tags", headers=ann)).status_code == 200
                assert (await http.patch("/api/keys/ann", headers=boss, json={"weight": -1})).status_code == 400
        async with open_test_server(models, usage_db=tmp_path / "usage.db") as server:  # restarted without TRIOSHED_API_KEY
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                assert (await http.get("/api/tags")).status_code == 401  # the store's key is in force
                assert (await http.get("/api/tags", headers=ann)).status_code == 200


async def test_budgets_fail_closed_while_the_database_cannot_be_reached_and_serving_goes_on(tmp_path: Path) -> None:
    """A node whose database is down from the start serves; with TRIOSHED_BUDGETS_FAIL_CLOSED a
    key with budgets is refused (503, Retry-After) on both serving paths, keys without budgets are
    served, and /api/ps says why (without the password)."""
    models = tmp_path / "models"
    models.mkdir()
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-1"\ntokens_per_day = 1000\n'
                    '[[key]]\nname = "bob"\nkey = "bob-secret-1"\n')  # fmt: skip
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/postgres"  # nothing listens there
    ask = {"model": "nothing-here", "prompt": "hi", "stream": False}
    with trio.fail_after(60):
        async with open_test_server(models, api_key="boss-secret-1", keys_file=keys, database=url, budgets_fail_closed=True) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                ann, bob = {"Authorization": "Bearer ann-secret-1"}, {"Authorization": "Bearer bob-secret-1"}
                refused = await http.post("/api/generate", headers=ann, json=ask)  # the fast path
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
                assert "API key 'ann' has token budgets and the usage database is unreachable" in refused.json()["error"]
                assert (await http.post("/api/embed", headers=ann, json={"model": "nothing-here", "input": "x"})).status_code == 503
                assert (await http.get("/api/tags", headers=ann)).status_code == 200  # spends nothing: served
                assert (await http.post("/api/generate", headers=bob, json=ask)).status_code == 404  # no budget: past the gate
                ps = (await http.get("/api/ps", headers={"Authorization": "Bearer boss-secret-1"})).json()
                assert ps["database"]["reachable"] is False and ps["database"]["problem"] == "is unreachable"
                assert PASSWORD not in str(ps) and "postgres:***@127.0.0.1:1" in ps["database"]["where"]
