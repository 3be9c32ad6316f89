"""Keys across nodes sharing a real PostgreSQL (in-process trioshed nodes, Debian's PostgreSQL):
a key made on one node works on another at once, and wrong keys cost the store nothing per
request; a forwarded request runs with the serving node's own record of its key, and a node cut
off from the database stops honouring keys made over the API after TRIOSHED_KEYS_STALE; budgets
hold where a request is served, on every route; ``default`` is reserved everywhere and two nodes'
keys files never overwrite each other; two changes of one key at once both hold."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.fleet_nodes import Node, sees, wait_until
from tests.support.postgres import fresh_database, needs_postgres, postgres  # noqa: F401
from tests.support.tcp_proxy import open_tcp_proxy
from trioshed.fleet.auth import FleetAuth, body_digest
from trioshed.keys import digest
from trioshed.server import Server
from trioshed.testing.llama import free_port
from trioshed.testing.postgres import Postgres
from trioshed.testing.server import open_test_server
from trioshed.usage.ledger import Spend
from trioshed.usage.store import KeyRow

BOSS = {"Authorization": "Bearer boss-secret-1"}
ASK = {"model": "nothing-here", "prompt": "hi", "stream": False}
SECRET = "team-keys-test-secret"


async def status(server: Server, method: str, path: str, headers: dict[str, str], **kw: object) -> int:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        return (await client.request(method, path, headers=headers, **kw)).status_code  # type: ignore[arg-type]


@asynccontextmanager
async def team(tmp_path: Path, url: str, n: int = 2, **more: object) -> AsyncIterator[list[Server]]:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_test_server(models, api_key="boss-secret-1", database=url, node_name=name, **more))
            for name in "abc"[:n]
        ]


@needs_postgres
async def test_a_key_made_on_one_node_works_on_another_at_once_and_wrong_keys_cost_the_store_nothing(postgres: Postgres, tmp_path: Path) -> None:  # noqa: F811
    async with team(tmp_path, fresh_database(postgres)) as (a, b):
        sync = b.state.key_sync
        assert sync is not None
        for _ in range(3):  # a script: make a key, use it at once, on another node
            async with httpx.AsyncClient(base_url=a.base_url, timeout=30) as client:
                made = await client.post("/api/keys", headers=BOSS, json={"name": f"k{time.monotonic_ns()}"})
            assert made.status_code == 201
            assert await status(b, "POST", "/api/generate", {"Authorization": f"Bearer {made.json()['key']}"}, json=ASK) == 404  # past the gate
        before = sync.lookups
        async with httpx.AsyncClient(base_url=b.base_url, timeout=30) as client:
            codes: list[int] = []

            async def ask(i: int) -> None:
                codes.append((await client.get("/api/tags", headers={"Authorization": f"Bearer wrong-{i % 20}"})).status_code)

            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(60):  # 20 wrong keys, each three times, at once
                    nursery.start_soon(ask, i)
        assert codes == [401] * 60
        readings = sync.lookups - before
        assert 1 <= readings <= 2 + (trio.current_time() - started) / 0.05, readings  # one per 50 ms at most, shared
        again = sync.lookups
        for _ in range(10):  # the same wrong key again: refused at once, the store not asked
            assert await status(b, "GET", "/api/tags", {"Authorization": "Bearer wrong-1"}) == 401
        assert sync.lookups == again


@needs_postgres
async def test_a_forwarded_request_runs_with_the_serving_nodes_record_of_its_key(postgres: Postgres, tmp_path: Path) -> None:  # noqa: F811
    """A is cut off from the database (a TCP proxy between them, then cut); a key revoked on B
    meanwhile is refused by B for what A forwards, and by A itself once its keys are stale."""
    url = fresh_database(postgres)
    host_port = int(url.rsplit(":", 1)[1].split("/")[0])
    models = tmp_path / "models"
    add_tiny(models, "m1")
    port_a, port_b = free_port(), free_port()
    fleet = {"fleet_secret": SECRET, "fleet_interval": 0.1, "fleet_stale": 2.0, "api_key": "boss-secret-1"}
    rec_a: list[tuple[str, str]] = []
    rec_b: list[tuple[str, str]] = []
    with trio.fail_after(120):
        async with open_tcp_proxy(host_port) as proxy:
            via_proxy = url.replace(f":{host_port}/", f":{proxy.port}/")
            async with (
                open_test_server(models, record=rec_b, port=port_b, node_name="B", database=url, peers=(f"http://127.0.0.1:{port_a}",), **fleet) as server_b,
                open_test_server(models, record=rec_a, port=port_a, node_name="A", database=via_proxy, keys_stale=1.0,
                                 peers=(f"http://127.0.0.1:{port_b}",), **fleet) as server_a,
            ):  # fmt: skip
                a, b = Node("A", server_a, rec_a), Node("B", server_b, rec_b)
                async with httpx.AsyncClient(timeout=60) as http:
                    made = await http.post(a.url + "/api/keys", headers=BOSS, json={"name": "ann"})
                    ann = {"Authorization": f"Bearer {made.json()['key']}"}
                    gen = {"model": "m1", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
                    assert (await http.post(b.url + "/api/generate", json=gen, headers=ann)).status_code == 200  # warm on B
                    await wait_until(lambda: sees(a, b, "m1:latest"), a)
                    assert (await http.post(a.url + "/api/generate", json=gen, headers=ann)).status_code == 200  # forwarded
                    assert b.dispatches("m1") == 2
                    proxy.cut()  # A cannot read the database any more
                    assert (await http.delete(b.url + "/api/keys/ann", headers=BOSS)).status_code == 200
                    r = await http.post(a.url + "/api/generate", json=gen, headers=ann)  # A still believes in ann
                    assert r.status_code == 401 and "not known on this node" in r.json()["error"], r.text
                    assert b.dispatches("m1") == 2 and a.loads() == 0
                    await trio.sleep(1.2)  # A's keys are stale: ann is made over the API, A cannot know it is revoked
                    r = await http.get(a.url + "/api/tags", headers=ann)
                    assert r.status_code == 503 and "TRIOSHED_KEYS_STALE" in r.json()["error"] and r.headers["Retry-After"]
                    assert (await http.get(a.url + "/api/tags", headers=BOSS)).status_code == 200  # its own admin key works on


@needs_postgres
async def test_budgets_are_checked_where_a_request_is_served_on_every_route(postgres: Postgres, tmp_path: Path) -> None:  # noqa: F811
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-1"\ntokens_per_day = 100\nrole = "admin"\n')
    async with team(tmp_path, fresh_database(postgres), n=1, keys_file=keys, fleet_secret=SECRET, peers=("http://127.0.0.1:9",)) as (node,):
        assert node.state.usage is not None
        node.state.usage.record(Spend("ann", "m", time.time(), prompt=80, completion=40))  # over its budget
        a = FleetAuth(SECRET, "other")
        async with httpx.AsyncClient(base_url=node.base_url, timeout=30) as http:
            for method, path, body in (
                ("POST", "/api/embed", b'{"model": "nothing-here", "input": "x"}'),
                ("POST", "/v1/embeddings", b'{"model": "nothing-here", "input": "x"}'),
                ("POST", "/api/rerank", b'{"model": "nothing-here", "query": "q", "documents": ["d"]}'),
                ("POST", "/upstream/nothing-here/completion", b'{"prompt": "x"}'),
                ("POST", "/api/generate", b'{"model": "nothing-here", "prompt": "x"}'),
            ):
                signed = a.sign(method, path, body_digest(body), to="a", key="ann")  # forwarded by another node
                r = await http.request(method, path, content=body, headers={**signed, "Content-Type": "application/json"})
                assert r.status_code == 429 and "tokens per day" in r.text, (path, r.text)
                r = await http.request(method, path, content=body, headers={"Authorization": "Bearer ann-secret-1", "Content-Type": "application/json"})
                assert r.status_code == 429, (path, r.text)  # and sent to it directly


@needs_postgres
async def test_default_is_reserved_everywhere_and_two_keys_files_never_overwrite_each_other(
    postgres: Postgres, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level(logging.ERROR)
    url = fresh_database(postgres)
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-first"\n')
    second.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-second"\nrole = "admin"\n')
    async with team(tmp_path, url, n=1, keys_file=first) as (a,):
        assert a.state.usage is not None
        # a store from before the name was reserved, holding a key named default
        await a.state.usage.call(lambda db: db.create_key(KeyRow("default", digest("old-default-secret"), "admin")))
        async with open_test_server(tmp_path / "models", api_key="boss-secret-2", database=url, node_name="b", keys_file=second) as b:
            for node, own in ((a, "boss-secret-1"), (b, "boss-secret-2")):
                assert await status(node, "GET", "/api/ps", {"Authorization": f"Bearer {own}"}) == 200  # its own admin key
                assert await status(node, "GET", "/api/tags", {"Authorization": "Bearer old-default-secret"}) == 401
                assert await status(node, "GET", "/api/tags", {"Authorization": "Bearer ann-secret-first"}) == 200  # the first file's
                assert await status(node, "GET", "/api/tags", {"Authorization": "Bearer ann-secret-second"}) == 401
            assert any("'ann' is another node's in the store" in r.getMessage() for r in caplog.records)
            async with httpx.AsyncClient(base_url=b.base_url, timeout=30) as http:
                boss = {"Authorization": "Bearer boss-secret-2"}
                for method, path in (("DELETE", "/api/keys/default"), ("POST", "/api/keys/default/rotate"), ("PATCH", "/api/keys/default")):
                    r = await http.request(method, path, headers=boss, json={"role": "user"})
                    assert r.status_code == 400 and "TRIOSHED_API_KEY" in r.json()["error"], (method, r.text)
                assert (await http.post("/api/keys", headers=boss, json={"name": "default"})).status_code == 400
                assert (await http.get("/api/ps", headers=boss)).status_code == 200
    bad = tmp_path / "bad.toml"
    bad.write_text('[[key]]\nname = "default"\nkey = "a-secret-of-its-own"\n')
    from trioshed.config import Settings

    with pytest.raises(ValueError, match="'default' is TRIOSHED_API_KEY's"):
        Settings(models=tmp_path / "models", keys_file=bad).validate()


async def test_two_changes_of_one_key_at_once_both_hold(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    async with open_test_server(models, api_key="boss-secret-1") as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        for i in range(8):
            name = f"k{i}"
            assert (await http.post("/api/keys", headers=BOSS, json={"name": name})).status_code == 201

            async def change(body: dict[str, int], name: str = name) -> None:
                assert (await http.patch(f"/api/keys/{name}", headers=BOSS, json=body)).status_code == 200

            async with trio.open_nursery() as nursery:  # two administrators at once, different fields
                nursery.start_soon(change, {"tokens_per_day": 5})
                nursery.start_soon(change, {"max_queued": 3})
            (row,) = [k for k in (await http.get("/api/keys", headers=BOSS)).json()["keys"] if k["name"] == name]
            assert (row["tokens_per_day"], row["max_queued"]) == (5, 3), row
