"""The static list of peers (``TRIOSHED_PEERS``) and the names its nodes answer with: this node
found in the list by its name and its run's token, and a node answering with a name another node
has (this node's, or an earlier node's of the list) routed nothing, with an error in the view and
one log line. The nodes' answers come from an in-memory transport (the real nodes:
tests/e2e/test_fleet_e2e.py)."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
import trio.testing

from trioshed.core.route import NodeState
from trioshed.fleet.auth import FleetAuth
from trioshed.fleet.node import routable
from trioshed.fleet.peers import STATE_PATH, StaticPeers
from trioshed.fleet.state import to_json

ANSWERS = {
    "http://n1:1": NodeState(name="A", instance="me"),  # this node itself
    "http://n2:1": NodeState(name="A", instance="someone-else"),  # given this node's name too
    "http://n3:1": NodeState(name="C", instance="c1"),
    "http://n4:1": NodeState(name="C", instance="c2"),  # given C's name too
    "http://n5:1": NodeState(name="D", instance=""),  # a node that sends no token
}


def _answer(request: httpx.Request) -> httpx.Response:
    assert request.url.path == STATE_PATH and request.headers.get("x-trioshed-fleet-signature", "").startswith("v1;")
    assert "x-trioshed-fleet-secret" not in request.headers and "s3cret" not in str(request.headers)
    state = ANSWERS[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
    return httpx.Response(200, json=to_json(state))


async def test_a_node_answering_with_a_name_another_node_has_is_routed_nothing_and_said_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_answer)) as client:
        peers = StaticPeers(tuple(ANSWERS), FleetAuth("s3cret"), "A", client, interval=1.0, self_instance="me")
        async with trio.open_nursery() as nursery:
            await nursery.start(peers.run)
            for _ in range(3):
                await peers.rounds.wait()
            seen = {p.url: p for p in peers.peers()}
            nursery.cancel_scope.cancel()
    assert "http://n1:1" not in seen  # itself
    assert [u for u, p in seen.items() if p.state.reachable] == ["http://n3:1", "http://n5:1"]
    assert "TRIOSHED_NODE_NAME" in seen["http://n2:1"].error and "'A'" in seen["http://n2:1"].error
    assert "'C'" in seen["http://n4:1"].error
    assert "http://n2:1" in peers.conflict and "this node's name 'A'" in peers.conflict
    errors = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert len(errors) == 2 and "n2:1" in errors[0] and "n4:1" in errors[1]
    # C's traffic goes to the first node answering as C, never to the one that took its name
    assert routable(tuple(seen.values())) == {"C": "http://n3:1", "D": "http://n5:1"}


async def test_without_a_second_node_of_its_name_no_conflict_is_shown() -> None:
    answers = {k: v for k, v in ANSWERS.items() if k in ("http://n1:1", "http://n3:1")}
    async with httpx.AsyncClient(transport=httpx.MockTransport(_answer)) as client:
        peers = StaticPeers(tuple(answers), FleetAuth("s3cret"), "A", client, interval=1.0, self_instance="me")
        async with trio.open_nursery() as nursery:
            await nursery.start(peers.run)
            await peers.rounds.wait()
            nursery.cancel_scope.cancel()
    assert [p.state.name for p in peers.peers()] == ["C"] and peers.conflict == ""
