"""Three real trioshed nodes on loopback (real llama-server children, a tiny model) that know each
other only through a real PostgreSQL: no ``TRIOSHED_PEERS``, each node's row written to the
shared database at the address it listens on. A model warm on B is served by B for requests
arriving at A and C, and a node stopped cleanly removes its row and leaves every view."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import psycopg
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.fleet_nodes import SECRET, Node, sees, wait_until
from tests.support.postgres import fresh_database, needs_postgres, postgres  # noqa: F401
from trioshed.fleet.dbpeers import DatabasePeers
from trioshed.testing.postgres import Postgres
from trioshed.testing.server import open_test_server
from trioshed.usage.pg import PgStore

pytestmark = [needs_postgres, pytest.mark.slow]

GEN = {"prompt": "hi", "stream": False, "options": {"num_predict": 2}}


def fleet_setup(postgres: Postgres, tmp_path: Path, **more: object) -> tuple[str, Path, dict[str, object]]:  # noqa: F811
    """A fresh database, a store with the tiny model ``m1``, and the nodes' fleet settings."""
    database = fresh_database(postgres)
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    return database, store, {"database": database, "fleet_secret": SECRET, "fleet_interval": 0.1, "fleet_stale": 2.0, **more}


def rows(url: str) -> dict[str, tuple[str, dict[str, object]]]:
    with psycopg.connect(url) as conn:
        return {n: (u, json.loads(s)) for n, u, s in conn.execute("SELECT name, url, state FROM fleet_nodes").fetchall()}


async def test_nodes_found_through_the_database_serve_a_model_where_it_is_warm_and_a_stopped_node_leaves(
    postgres: Postgres,  # noqa: F811
    tmp_path: Path,
) -> None:
    database, store, settings = fleet_setup(postgres, tmp_path)
    with trio.fail_after(150):
        async with AsyncExitStack() as stack:
            nodes: list[Node] = []
            for name in ("A", "B"):
                record: list[tuple[str, str]] = []
                server = await stack.enter_async_context(open_test_server(store, record=record, node_name=name, **settings))
                nodes.append(Node(name, server, record))
            a, b = nodes
            c_record: list[tuple[str, str]] = []
            async with open_test_server(store, record=c_record, node_name="C", **settings) as c_server:
                c = Node("C", c_server, c_record)
                for node in (a, b, c):
                    assert node.server.settings.peers == ()
                    assert isinstance(node.server.state.fleet and node.server.state.fleet.source, DatabasePeers)
                    await wait_until(lambda node=node: all(sees(node, o) for o in (a, b, c) if o is not node), node)  # type: ignore[misc]
                table = await trio.to_thread.run_sync(rows, database)
                assert {n: u for n, (u, _) in table.items()} == {n.name: n.url for n in (a, b, c)}  # where each listens
                assert table["B"][1]["name"] == "B" and table["B"][1]["draining"] is False
                async with httpx.AsyncClient(timeout=60) as http:
                    warm = await http.post(b.url + "/api/generate", json={"model": "m1", **GEN})
                    assert warm.status_code == 200, warm.text
                    await wait_until(lambda: sees(a, b, "m1:latest"), a)
                    await wait_until(lambda: sees(c, b, "m1:latest"), c)
                    for node in (a, c):  # arriving at A and at C: relayed over HTTP to B's URL from its row
                        for _ in range(2):
                            r = await http.post(node.url + "/api/generate", json={"model": "m1", **GEN})
                            assert r.status_code == 200, r.text
                            assert r.json()["done"] is True
                assert b.dispatches("m1") == 1 + 4  # B's runner served every one of them
                assert (a.loads(), b.loads(), c.loads()) == (0, 1, 0)
                assert a.dispatches("m1") == c.dispatches("m1") == 0
                for node in (a, c):
                    assert node.server.state.fleet is not None and node.server.state.fleet.counts["forwarded"] == 2
            # C stopped cleanly: its row is gone, and A and B no longer list it
            assert set(await trio.to_thread.run_sync(rows, database)) == {"A", "B"}
            for node in (a, b):
                fleet = node.server.state.fleet
                assert fleet is not None
                await wait_until(lambda fleet=fleet: "C" not in {p.state.name for p in fleet.peers()}, node)  # type: ignore[misc]
            async with httpx.AsyncClient(base_url=a.url, timeout=30) as http:
                listed = (await http.get("/api/ps")).json()["nodes"]
                assert [n["name"] for n in listed] == ["A", "B"]
        assert await trio.to_thread.run_sync(rows, database) == {}


def test_the_table_ages_rows_by_the_databases_clock_and_forgets_rows_not_written_for_long(postgres: Postgres) -> None:  # noqa: F811
    database = fresh_database(postgres)
    table = PgStore(database)
    try:
        assert table.exchange("A", ("http://127.0.0.1:1", '{"a": 1}'), 3600) == []
        [(name, url, state, age)] = table.exchange("B", ("http://127.0.0.1:2", "{}"), 3600)
        assert (name, url, state) == ("A", "http://127.0.0.1:1", '{"a": 1}') and 0 <= age < 5
        # every row, B's own as it was before this write (a node reads what it last wrote there)
        [a, b] = table.exchange("B", ("http://127.0.0.1:2", '{"b": 2}'), 3600)
        assert a[:3] == ("A", "http://127.0.0.1:1", '{"a": 1}') and b[:3] == ("B", "http://127.0.0.1:2", "{}")
        with psycopg.connect(database, autocommit=True) as conn:  # A wrote 30 s ago, by the database's clock
            conn.execute("UPDATE fleet_nodes SET updated = updated - interval '30 seconds' WHERE name = 'A'")
        [(_, _, _, age), (_, _, b_state, _)] = table.exchange("B", None, 3600)
        assert 30 <= age < 35 and b_state == '{"b": 2}'
        assert [r[0] for r in table.exchange("B", None, 20)] == ["B"]  # A not written for 20 s: forgotten
        table.withdraw("B")
        assert rows(database) == {}
    finally:
        table.close()


async def test_two_real_nodes_given_one_name_each_show_the_conflict_in_their_view(
    postgres: Postgres,  # noqa: F811
    tmp_path: Path,
) -> None:
    _, store, settings = fleet_setup(postgres, tmp_path)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            servers = [await stack.enter_async_context(open_test_server(store, node_name="A", **settings)) for _ in range(2)]
            for server in servers:
                source = server.state.fleet and server.state.fleet.source
                assert isinstance(source, DatabasePeers)
                with trio.fail_after(30):
                    while not source.conflict:
                        await source.rounds.wait()
            async with httpx.AsyncClient(timeout=30) as http:
                for server, other in (servers, servers[::-1]):
                    [me] = (await http.get(server.urls[0] + "/api/ps")).json()["nodes"]  # no peer: one row between them
                    assert me["name"] == "A" and "TRIOSHED_NODE_NAME" in me["error"] and other.urls[0] in me["error"]


async def test_a_draining_node_found_through_the_database_is_given_nothing_new(
    postgres: Postgres,  # noqa: F811
    tmp_path: Path,
) -> None:
    """B holds the model warm, then drains (a shutdown, held open by a request still sending its
    body): its row says so within an interval, and A serves the model itself from then on."""
    database, store, settings = fleet_setup(postgres, tmp_path, shutdown_timeout=60.0)
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            a_record: list[tuple[str, str]] = []
            a = Node("A", await stack.enter_async_context(open_test_server(store, record=a_record, node_name="A", **settings)), a_record)
            b_record: list[tuple[str, str]] = []
            b_open, b_done = trio.Event(), trio.Event()
            b_holder: list[Node] = []

            async def run_b() -> None:
                async with open_test_server(store, record=b_record, node_name="B", **settings) as server:
                    b_holder.append(Node("B", server, b_record))
                    b_open.set()
                    await b_done.wait()

            nursery.start_soon(run_b)
            await b_open.wait()
            b = b_holder[0]
            async with httpx.AsyncClient(timeout=60) as http:
                warm = await http.post(b.url + "/api/generate", json={"model": "m1", **GEN})
                assert warm.status_code == 200, warm.text
                await wait_until(lambda: sees(a, b, "m1:latest"), a)
                r = await http.post(a.url + "/api/generate", json={"model": "m1", **GEN})
                assert r.status_code == 200 and b.dispatches("m1") == 2 and a.loads() == 0  # forwarded to B
                # a request to B still sending its body keeps B's drain open
                host, port = b.url.removeprefix("http://").split(":")
                held = await trio.open_tcp_stream(host, int(port))
                body = json.dumps({"model": "m1", **GEN}).encode()
                await held.send_all(
                    f"POST /api/generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5]
                )
                await trio.sleep(0.2)  # its head read: in flight
                b.server.drain.requested.set()
                await wait_until(lambda: any(p.state.name == "B" and p.state.draining for p in a.server.state.fleet.peers()), a)  # type: ignore[union-attr]
                assert (await trio.to_thread.run_sync(rows, database))["B"][1]["draining"] is True
                for _ in range(2):
                    r = await http.post(a.url + "/api/generate", json={"model": "m1", **GEN})
                    assert r.status_code == 200, r.text
                assert b.dispatches("m1") == 2 and a.loads() == 1 and a.dispatches("m1") == 2  # served at A, not B
                counts = a.server.state.fleet.counts  # type: ignore[union-attr]
                assert counts["forwarded"] == 1 and counts["relay_failed"] == 0  # not even tried at B (its 503)
                await held.send_all(body[5:])  # B's last request ends, and with it B's drain
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await held.receive_some(65536)
                assert answer.startswith(b"HTTP/1.1 200")
                await held.aclose()
            await wait_until(lambda: "B" not in {p.state.name for p in a.server.state.fleet.peers()}, a)  # type: ignore[union-attr]
            b_done.set()  # B's drain ended, its row removed: its serve() has returned
