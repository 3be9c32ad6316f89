"""Three real trioshed nodes with real llama-server children on loopback, as one fleet behind
the packaged HAProxy config: requests are served where their model is warm, a hot model spreads,
a node's death loses no whole request, streams are relayed and cancelled, forged node headers
are refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.fleet_nodes import SECRET, open_fleet, sees, wait_until
from tests.haproxy import needs_haproxy, run_haproxy
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
                ok = await http.get("/api/fleet/state", headers={"X-Trioshed-Fleet-Secret": SECRET})
                assert ok.status_code == 200 and ok.json()["name"] == "A"
            assert a.loads() == 0
        async with open_test_server(store) as alone:  # a node in no fleet takes no node request
            async with httpx.AsyncClient(base_url=alone.base_url, timeout=30) as http:
                r = await http.post("/api/generate", json=body, headers={**forged, "X-Trioshed-Fleet-Secret": SECRET})
                assert r.status_code == 403, r.text
                assert (await http.get("/api/fleet/state", headers={"X-Trioshed-Fleet-Secret": SECRET})).status_code == 403
