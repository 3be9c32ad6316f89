"""Three real trioshed nodes with real llama-server children on loopback, as one fleet behind
the packaged HAProxy config: requests are served where their model is warm, a hot model spreads,
a node's death loses no whole request, streams are relayed and cancelled, forged node headers
are refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.fleet_nodes import SECRET, open_fleet, sees, wait_until
from tests.support.haproxy import needs_haproxy, run_haproxy
from tests.support.serve_process import serve_process
from trioshed.fleet.auth import FleetAuth, body_digest
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server

pytestmark = pytest.mark.slow

GEN = {"prompt": "hi", "stream": False, "options": {"num_predict": 2}}


@needs_haproxy
async def test_a_model_warm_on_one_node_is_served_there_for_requests_arriving_anywhere(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    with trio.fail_after(120):
        async with open_fleet([store]) as (a, b, c):
            async with httpx.AsyncClient(timeout=60) as http:
                warm = await http.post(b.url + "/api/generate", json={"model": "m1", **GEN})
                assert warm.status_code == 200, warm.text
                await wait_until(lambda: sees(a, b, "m1:latest"), a)
                await wait_until(lambda: sees(c, b, "m1:latest"), c)
                for node in (a, c):  # arriving at A and at C directly
                    for _ in range(2):
                        r = await http.post(node.url + "/api/generate", json={"model": "m1", **GEN})
                        assert r.status_code == 200, r.text
                        assert r.json()["done"] is True
                chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                r = await http.post(c.url + "/v1/chat/completions", json=chat)
                assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
            async with run_haproxy(tmp_path, [a.url, b.url, c.url], "trioshed_fleet") as front:
                async with httpx.AsyncClient(base_url=front, timeout=60) as http:
                    for _ in range(6):
                        r = await http.post("/api/generate", json={"model": "m1", **GEN})
                        assert r.status_code == 200, r.text
            assert b.dispatches("m1") == 1 + 4 + 1 + 6  # B's runner served every one of them
            assert (a.loads(), b.loads(), c.loads()) == (0, 1, 0)
            assert a.dispatches("m1") == c.dispatches("m1") == 0
            for node in (a, c):
                assert node.server.state.fleet is not None and node.server.state.fleet.counts["forwarded"] >= 3


async def test_forged_node_headers_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    body = {"model": "m1", **GEN}
    with trio.fail_after(60):
        async with open_fleet([store], names=("A",)) as (a,):
            async with httpx.AsyncClient(base_url=a.url, timeout=30) as http:
                forged = {"X-Trioshed-Forwarded": "evil", "X-Trioshed-Fleet-Key": '{"name":"admin","role":"admin"}'}
                for headers in (forged, {**forged, "X-Trioshed-Fleet-Secret": "wrong"}, {"X-Trioshed-Fleet-Secret": "wrong"}):
                    r = await http.post("/api/generate", json=body, headers=headers)
                    assert r.status_code == 401, r.text
                    assert SECRET not in r.text
                    r = await http.post("/v1/chat/completions", json={"model": "m1", "messages": []}, headers=headers)
                    assert r.status_code == 401 and "error" in r.json()
                assert (await http.get("/api/fleet/state")).status_code == 401
                assert (await http.get("/api/fleet/state", headers={"X-Trioshed-Fleet-Secret": SECRET})).status_code == 401  # no bearer
                ok = await http.get("/api/fleet/state", headers=state_request())
                assert ok.status_code == 200 and ok.json()["name"] == "A"
            assert a.loads() == 0
        async with open_test_server(store) as alone:  # a node in no fleet takes no node request
            async with httpx.AsyncClient(base_url=alone.base_url, timeout=30) as http:
                content = json.dumps(body).encode()
                signed = FleetAuth(SECRET, "B").sign("POST", "/api/generate", body_digest(content), to="", key=None)
                r = await http.post("/api/generate", content=content, headers={**signed, "Content-Type": "application/json"})
                assert r.status_code == 403, r.text
                assert (await http.get("/api/fleet/state", headers=state_request())).status_code == 403


def state_request() -> dict[str, str]:
    """The headers of a state poll from another node of the fleet."""
    return FleetAuth(SECRET, "B").sign("GET", "/api/fleet/state", body_digest(b""), to="", key=None)


async def test_a_hot_model_spreads_to_a_second_node_under_a_burst(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    with trio.fail_after(180):
        async with open_fleet([store]) as (a, b, c):
            async with httpx.AsyncClient(timeout=120) as http:
                assert (await http.post(b.url + "/api/generate", json={"model": "m1", **GEN})).status_code == 200
                await wait_until(lambda: sees(a, b, "m1:latest"), a)
                statuses: list[int] = []

                async def one(i: int) -> None:
                    body = {"model": "m1", "prompt": f"burst {i}", "stream": False, "options": {"num_predict": 16}}
                    statuses.append((await http.post(a.url + "/api/generate", json=body)).status_code)

                async with trio.open_nursery() as nursery:
                    for i in range(8):  # one slot on B: a queue there, then a second copy
                        nursery.start_soon(one, i)
            assert statuses == [200] * 8
            served = {n.name: n.dispatches("m1") for n in (a, b, c)}
            assert sum(served.values()) == 9, served
            assert b.loads() == 1 and sum(1 for n in served.values() if n) >= 2, served
            assert sum(n.loads() for n in (a, b, c)) <= 3


async def test_a_node_killed_under_load_loses_no_whole_request(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    port_b = free_port()
    url_b = f"http://127.0.0.1:{port_b}"
    with trio.fail_after(180):
        async with open_fleet([store], names=("A", "C"), peers_extra=(url_b,)) as (a, c):
            env = {"TRIOSHED_PEERS": ",".join((a.url, c.url)), "TRIOSHED_FLEET_SECRET": SECRET, "TRIOSHED_NODE_NAME": "B",
                   "TRIOSHED_FLEET_INTERVAL": "0.1", "TRIOSHED_KV_CACHE_BUDGET": "0"}  # fmt: skip
            async with serve_process(store, port_b, **env) as b_process:
                async with httpx.AsyncClient(timeout=120) as http:
                    assert (await http.post(url_b + "/api/generate", json={"model": "m1", **GEN})).status_code == 200
                    fleet = a.server.state.fleet
                    assert fleet is not None
                    b_warm = lambda: any(p.state.name == "B" and "m1:latest" in p.state.loaded for p in fleet.peers())  # noqa: E731
                    await wait_until(b_warm, a)
                    statuses: list[int] = []

                    async def one(i: int) -> None:  # a whole answer of 400 tokens (end of sequence ignored)
                        body = {"prompt": f"load {i}", "n_predict": 400, "ignore_eos": True}
                        response = await http.post(a.url + "/upstream/m1/completion", json=body)
                        statuses.append(response.status_code)
                        assert response.json()["tokens_predicted"] == 400

                    async with trio.open_nursery() as nursery:
                        for i in range(4):
                            nursery.start_soon(one, i)
                        while fleet.inflight("B") < 1 and len(statuses) < 4:
                            await fleet.sending.wait()
                        assert fleet.inflight("B") >= 1, "B answered everything before it could be killed"
                        b_process.process.kill()  # SIGKILL: B dies with requests of A in flight
                    assert statuses == [200] * 4
                    assert fleet.counts["relay_failed"] >= 1  # those ran again elsewhere
                    assert await b_process.wait_exit() != 0


async def test_a_forwarded_stream_is_relayed_and_a_disconnect_cancels_it_upstream(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    with trio.fail_after(120):
        async with open_fleet([store], names=("A", "B")) as (a, b):
            async with httpx.AsyncClient(timeout=60) as http:
                assert (await http.post(b.url + "/api/generate", json={"model": "m1", **GEN})).status_code == 200
                await wait_until(lambda: sees(a, b, "m1:latest"), a)
                # Ollama's NDJSON stream, relayed whole
                body = {"model": "m1", "prompt": "tell", "options": {"num_predict": 8, "temperature": 0}}
                direct = await http.post(b.url + "/api/generate", json=body)
                relayed = await http.post(a.url + "/api/generate", json=body)
                assert relayed.headers["content-type"] == direct.headers["content-type"] == "application/x-ndjson"
                strip = lambda text: [{k: v for k, v in json.loads(line).items() if "duration" not in k and k != "created_at"} for line in text.splitlines()]  # noqa: E731
                assert strip(relayed.text) == strip(direct.text)
                # a stream that would run for minutes (end of sequence ignored), left after one chunk
                endless = {"prompt": "go", "n_predict": 100000, "ignore_eos": True, "stream": True}
                async with http.stream("POST", a.url + "/upstream/m1/completion", json=endless) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    await response.aiter_bytes().__anext__()
                    assert b.server.scheduler.statistics().leased == 1
                with trio.fail_after(10):
                    await b.server.scheduler.wait_statistics(lambda s: s.leased == 0)
                fleet = a.server.state.fleet
                assert fleet is not None and fleet.inflight("B") == 0
            assert a.loads() == 0 and b.loads() == 1


async def test_one_view_lists_the_fleets_models_and_nodes_and_serves_a_model_only_another_node_has(tmp_path: Path) -> None:
    from trioshed.api.observe.events import state_message

    stores = [tmp_path / "a", tmp_path / "b"]
    for store, name in zip(stores, ("m1", "m2"), strict=True):
        store.mkdir()
        add_tiny(store, name)
    with trio.fail_after(120):
        async with open_fleet(stores, names=("A", "B")) as (a, b):
            async with httpx.AsyncClient(base_url=a.url, timeout=60) as http:
                tags = (await http.get("/api/tags")).json()["models"]
                assert [(m["name"], m.get("nodes")) for m in tags] == [("m1:latest", None), ("m2:latest", ["B"])]
                assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["m1", "m2"]
                r = await http.post("/api/generate", json={"model": "m2", **GEN})  # only B has it
                assert r.status_code == 200, r.text
                assert b.dispatches("m2") == 1 and a.loads() == 0
                await wait_until(lambda: sees(a, b, "m2:latest"), a)
                ps = (await http.get("/api/ps")).json()
                assert ps["models"] == []  # this node's runners, as Ollama's clients read them
                nodes = {n["name"]: n for n in ps["nodes"]}
                assert nodes["A"]["url"] == "" and nodes["B"]["reachable"] is True
                assert [m["model"] for m in nodes["B"]["loaded"]] == ["m2:latest"]
                assert nodes["B"]["devices"] and nodes["B"]["max_runners"] >= 1
                missing = await http.post("/api/generate", json={"model": "nowhere", **GEN})
                assert missing.status_code == 404
            fleet = state_message(a.server.state)["fleet"]
            assert [n["name"] for n in fleet] == ["A", "B"] and fleet[1]["loaded"][0]["model"] == "m2:latest"
