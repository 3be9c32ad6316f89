"""Each server's usage database is its own: by default ``<store>.usage.db`` beside its store, so
two servers with stores side by side never share keys or usage (real ``trioshed serve``
processes: one given a keys file, the other answers without a key), created 0600; an older
``usage.db`` beside a store keeps working for the store that claims it first."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import trio

from tests.support.serve_process import serve_process
from trioshed.config import Settings
from trioshed.keys import digest
from trioshed.testing.server import open_test_server
from trioshed.usage.db import UsageDB
from trioshed.usage.location import usage_file
from trioshed.usage.store import KeyRow


def databases(folder: Path) -> dict[str, int]:
    """The usage databases (and their journal files) in ``folder``, with their permissions."""
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if ".db" in p.name}


async def test_two_servers_with_stores_side_by_side_share_no_keys(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "alice"\nkey = "alice-secret-1"\n')
    with trio.fail_after(120):
        async with serve_process(tmp_path / "a", TRIOSHED_KEYS_FILE=str(keys)) as first, serve_process(tmp_path / "b") as second:
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.get(first.url + "/api/tags")).status_code == 401  # the keys it was given
                assert (await http.get(first.url + "/api/tags", headers={"Authorization": "Bearer alice-secret-1"})).status_code == 200
                assert (await http.get(second.url + "/api/tags")).status_code == 200  # none given: none asked
    found = databases(tmp_path)
    assert sorted(n for n in found if n.endswith(".db")) == ["a.usage.db", "b.usage.db"], found  # none shared
    assert set(found.values()) == {0o600}, found  # the journal files too


async def test_an_older_usage_db_beside_a_store_keeps_working_for_the_store_that_claims_it(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    old = UsageDB(tmp_path / "usage.db")  # what earlier versions made beside every store of the folder
    old.open()
    old.create_key(KeyRow("alice", digest("alice-secret-1")))
    old.close()
    (tmp_path / "usage.db").chmod(0o644)
    a, b = Settings(models=tmp_path / "a"), Settings(models=tmp_path / "b")
    assert a.usage_path == tmp_path / "a.usage.db"
    assert usage_file(a) == tmp_path / "usage.db"  # the first to find it claims it
    assert (tmp_path / "usage.db.store").read_text().strip() == str((tmp_path / "a").resolve())
    assert usage_file(b) == tmp_path / "b.usage.db"  # a sibling store starts its own
    assert usage_file(a) == tmp_path / "usage.db"  # and the claim holds
    assert usage_file(Settings(models=tmp_path / "b", usage_db=tmp_path / "usage.db")) == tmp_path / "usage.db"  # shared on purpose
    with trio.fail_after(60):
        async with open_test_server(tmp_path / "a") as server_a, open_test_server(tmp_path / "b") as server_b:
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.get(server_a.base_url + "/api/tags")).status_code == 401  # its keys kept working
                assert (await http.get(server_a.base_url + "/api/tags", headers={"Authorization": "Bearer alice-secret-1"})).status_code == 200
                assert (await http.get(server_b.base_url + "/api/tags")).status_code == 200
    assert databases(tmp_path)["usage.db"] == 0o600  # narrowed
