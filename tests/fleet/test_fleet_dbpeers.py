"""The fleet's nodes through the shared database, without a database: a node's row and the
state read back from it, staleness by the database's clock, and the source's life (nothing
written before the node listens, a database outage that keeps the last states until they are
stale and is logged once, a relay's failure holding a node down, the row removed at a clean stop)
over an in-memory table. The real PostgreSQL and real nodes: tests/e2e/test_fleet_db.py."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing

from trioshed.config import Settings
from trioshed.core.route import ModelLoad, NodeState
from trioshed.fleet.dbpeers import DatabasePeers, from_row, judged, to_row
from trioshed.fleet.state import VERSION, DeviceView
from trioshed.usage.store import StoreUnavailable

B = NodeState(
    name="B", models={"m1:latest": 3 << 20, "m2:latest": 5 << 20}, loaded={"m1:latest": ModelLoad(4, 1, 2, 2048, True)},
    room=1 << 30, runners=1, max_runners=3, queued=2, draining=False, prefixes=frozenset({"ab12"}),
)  # fmt: skip
DEVICES = (DeviceView("cuda:0", 8 << 30, 6 << 30, 1 << 30), DeviceView("cpu", 16 << 30, 9 << 30, 0))


def test_a_row_is_the_nodes_url_and_state_and_reads_back_seen_as_old_as_the_database_says() -> None:
    url, text = to_row(B, DEVICES, "http://10.0.0.2:11434")
    assert url == "http://10.0.0.2:11434" and json.loads(text)["version"] == VERSION
    peer = from_row("B", url, text, age=1.5, now=100.0, stale_after=5.0)
    assert peer.url == url and peer.error == "" and peer.devices == DEVICES
    assert peer.state == NodeState(**{**B.__dict__, "url": url, "seen": 98.5, "reachable": True})
    draining = from_row("B", url, to_row(NodeState(**{**B.__dict__, "draining": True}), (), url)[1], 0.0, 100.0, 5.0)
    assert draining.state.draining and draining.state.reachable  # reachable, and routed nothing new


def test_a_row_older_than_the_stale_limit_is_unreachable_with_its_age() -> None:
    url, text = to_row(B, (), "http://10.0.0.2:11434")
    assert from_row("B", url, text, 5.0, 100.0, 5.0).state.reachable  # at the limit: still fresh
    stale = from_row("B", url, text, 7.2, 100.0, 5.0)
    assert not stale.state.reachable and stale.state.seen == pytest.approx(92.8)
    assert stale.error == "its state is 7 s old (stale after 5 s)"
    fresh = from_row("B", url, text, 0.0, 100.0, 5.0)
    assert judged(fresh, 104.0, 5.0) is fresh
    assert judged(fresh, 106.0, 5.0).state.reachable is False  # ages on this node's clock between readings
    down = judged(fresh, 101.0, 5.0, "connection refused")
    assert (down.state.reachable, down.error) == (False, "connection refused")
    assert judged(down, 101.0, 5.0) == fresh  # the reason gone: reachable again


@pytest.mark.parametrize(
    ("name", "url", "text", "message"),
    [
        ("B", "10.0.0.2:11434", "{}", "not a node's URL"),
        ("B", "http://10.0.0.2", "{}", "not a node's URL"),
        ("B", "http://10.0.0.2:1/x", "{}", "not a node's URL"),
        ("B", "http://10.0.0.2:99999", "{}", "not a node's URL"),  # a port out of range: no connection can be made
        ("B", "http://10.0.0.2:0", "{}", "not a node's URL"),
        ("B", "gopher://10.0.0.2:70", "{}", "not a node's URL"),
        ("B", "http://10.0.0.2:1", "{nope", "not JSON"),
        ("B", "http://10.0.0.2:1", '{"version": 99}', "not a fleet state of version"),
        ("B", "http://10.0.0.2:1", '{"version": 1, "name": "B"}', "malformed fleet state"),
        ("C", "http://10.0.0.2:1", None, "holds the state of 'B'"),
    ],
)
def test_a_row_that_is_no_nodes_state_is_refused(name: str, url: str, text: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_row(name, url, text if text is not None else to_row(B, (), url)[1], 0.0, 10.0, 5.0)


class FakeTable:
    """The table in memory; ``ages`` of the other rows by the "database's" clock, set by the test."""

    where = "postgresql://db.example/team"

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str]] = {}
        self.ages: dict[str, float] = {}
        self.down = False
        self.calls: list[str] = []
        self.closed = False

    def exchange(self, me: str, mine: tuple[str, str] | None, forget_after: float) -> list[tuple[str, str, str, float]]:
        self.calls.append("exchange" if mine is None else "write")
        if self.down:
            raise StoreUnavailable("connection to server at 127.0.0.1 failed: Connection refused")
        rows = [(n, *self.rows[n], self.ages[n]) for n in sorted(self.rows)]  # this node's as it was
        if mine is not None:
            self.rows[me] = mine
            self.ages[me] = 0.0
        return rows

    def withdraw(self, me: str) -> None:
        self.calls.append("withdraw")
        self.rows.pop(me, None)

    def close(self) -> None:
        self.closed = True


def source(table: FakeTable) -> DatabasePeers:
    a = NodeState(name="A")
    return DatabasePeers(table, "A", lambda now: (a, ()), interval=1.0, stale_after=5.0)


async def test_a_node_writes_its_row_only_once_it_listens_and_removes_it_at_a_clean_stop(autojump_clock: trio.testing.MockClock) -> None:
    table = FakeTable()
    table.rows["B"] = to_row(B, DEVICES, "http://10.0.0.2:11434")
    table.ages["B"] = 0.5
    peers = source(table)
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.run)
        await peers.rounds.wait()
        assert "A" not in table.rows and table.calls == ["exchange"]  # not listening yet: read only
        [b] = peers.peers()
        assert (b.state.name, b.url, b.state.reachable, b.state.loaded) == ("B", "http://10.0.0.2:11434", True, B.loaded)
        peers.listening("http://127.0.0.1:4242")
        await peers.rounds.wait()
        assert table.rows["A"][0] == "http://127.0.0.1:4242" and json.loads(table.rows["A"][1])["name"] == "A"
        nursery.cancel_scope.cancel()
    assert "A" not in table.rows and table.calls[-1] == "withdraw" and table.closed


async def test_a_given_url_is_the_one_written() -> None:
    peers = DatabasePeers(FakeTable(), "A", lambda now: (NodeState(name="A"), ()), interval=1.0, stale_after=5.0, url="http://10.0.0.1:80")
    peers.listening("http://127.0.0.1:80")
    assert peers.url == "http://10.0.0.1:80"


async def test_a_database_outage_keeps_the_last_states_until_stale_and_is_logged_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "trioshed.fleet.dbpeers")
    table = FakeTable()
    table.rows["B"] = to_row(B, (), "http://10.0.0.2:11434")
    table.ages["B"] = 0.0
    peers = source(table)
    peers.listening("http://10.0.0.1:4242")
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.run)
        await peers.rounds.wait()
        seen = peers.peers()[0].state.seen
        table.down = True
        for _ in range(4):  # 4 s without the database: B's last state still routes
            await peers.rounds.wait()
            [b] = peers.peers()
            assert b.state.reachable and b.state.seen == seen
        for _ in range(3):
            await peers.rounds.wait()
        [b] = peers.peers()
        assert not b.state.reachable and "s old (stale after 5 s)" in b.error
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            "fleet: the database postgresql://db.example/team is unreachable: the other nodes keep their last "
            "state until it is 5 s old; trying again every 1 s"
        ]
        table.down = False
        await peers.rounds.wait()
        assert peers.peers()[0].state.reachable and "answers again" in caplog.records[-1].getMessage()
        nursery.cancel_scope.cancel()


async def test_a_node_a_relay_found_dead_gets_nothing_for_the_stale_time_and_a_node_gone_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = FakeTable()
    table.rows["B"] = to_row(B, (), "http://10.0.0.2:11434")
    table.ages["B"] = 0.0
    peers = source(table)
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.run)
        await peers.rounds.wait()
        peers.mark_down("B", "connection refused")
        for _ in range(4):  # its row is fresh, but this node could not reach it
            assert peers.peers()[0].state.reachable is False and peers.peers()[0].error == "connection refused"
            await peers.rounds.wait()
        for _ in range(2):
            await peers.rounds.wait()
        assert peers.peers()[0].state.reachable
        del table.rows["B"]  # B stopped: its row removed
        await peers.rounds.wait()
        assert peers.peers() == ()
        nursery.cancel_scope.cancel()


async def test_a_row_that_is_no_state_is_shown_unreachable_and_logged_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    table = FakeTable()
    table.rows["B"] = ("http://10.0.0.2:11434", '{"version": 99}')
    table.ages["B"] = 0.0
    peers = source(table)
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.run)
        for _ in range(3):
            await peers.rounds.wait()
        [b] = peers.peers()
        assert not b.state.reachable and "version" in b.error
        nursery.cancel_scope.cancel()
    assert sum("not usable" in r.getMessage() for r in caplog.records) == 1


def test_the_database_is_the_way_only_with_the_secret_and_no_list_and_needs_an_address_others_reach() -> None:
    db = {"TRIOSHED_DATABASE": "postgresql://u:pw@db.example/team", "TRIOSHED_FLEET_SECRET": "a-fleet-secret-0123"}
    assert Settings.from_env(db).fleet_discovery == "database"
    assert Settings.from_env({**db, "TRIOSHED_PEERS": "http://10.0.0.2:11434"}).fleet_discovery == "peers"
    assert Settings.from_env({"TRIOSHED_DATABASE": db["TRIOSHED_DATABASE"]}).fleet_discovery == ""
    for host in ("0.0.0.0", "[::]:8080"):
        with pytest.raises(ValueError, match="set TRIOSHED_FLEET_URL to this node's http://host:port"):
            Settings.from_env({**db, "TRIOSHED_HOST": host})
    given = Settings.from_env({**db, "TRIOSHED_HOST": "0.0.0.0", "TRIOSHED_FLEET_URL": "http://10.0.0.1:11434/"})
    assert given.fleet_url == "http://10.0.0.1:11434"
    assert Settings.from_env({**db, "TRIOSHED_HOST": "10.0.0.1"}).fleet_url_problem() is None
    assert Settings.from_env({"TRIOSHED_HOST": "0.0.0.0"}).fleet_url_problem() is None  # in no fleet: nothing to say
    for bad in ("10.0.0.1:11434", "ftp://10.0.0.1:443", "http://10.0.0.1", "http://0.0.0.0:11434", "http://h:99999", "http://h:0"):
        with pytest.raises(ValueError, match="TRIOSHED_FLEET_URL"):
            Settings.from_env({**db, "TRIOSHED_FLEET_URL": bad})
    tls = Settings.from_env({**db, "TRIOSHED_HOST": "0.0.0.0", "TRIOSHED_FLEET_URL": "https://node1.internal:8443"})
    assert tls.fleet_url == "https://node1.internal:8443"  # a TLS proxy in front of the node


def test_a_loopback_url_for_a_database_elsewhere_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "trioshed.fleet.dbpeers")
    peers = source(FakeTable())  # the database at db.example
    peers.listening("http://127.0.0.1:11434")
    assert "a loopback address only nodes on this machine reach" in caplog.records[-1].getMessage()
    table = FakeTable()
    table.where = "postgresql://u:***@127.0.0.1:5432/team"  # every node on this machine: fine
    source(table).listening("http://127.0.0.1:11434")
    assert caplog.records[-1].levelno == logging.INFO


async def test_two_nodes_given_one_name_each_find_the_other_writing_its_row_and_say_so_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    table = FakeTable()
    first = DatabasePeers(table, "A", lambda now: (NodeState(name="A", instance="1"), ()), interval=1.0, stale_after=5.0)
    second = DatabasePeers(table, "A", lambda now: (NodeState(name="A", instance="2"), ()), interval=1.0, stale_after=5.0)
    first.listening("http://10.0.0.1:11434")
    second.listening("http://10.0.0.2:11434")
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await first.rounds.wait()
        assert first.conflict == ""  # alone: its own row, as it wrote it
        await nursery.start(second.run)  # its first write is not judged: the row may be its last run's
        for _ in range(5):
            await first.rounds.wait()
        assert "name 'A'" in first.conflict and "written at http://10.0.0.2:11434" in first.conflict
        assert "written at http://10.0.0.1:11434" in second.conflict
        assert first.peers() == second.peers() == ()  # neither is the other's peer: one row
        del table.rows["A"]  # one of them stops cleanly: the other finds its row removed (said no more)
        await first.rounds.wait()
        await first.rounds.wait()
        nursery.cancel_scope.cancel()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("every node needs its own TRIOSHED_NODE_NAME" in e for e in errors)  # once each


async def test_a_restarted_node_finds_its_last_runs_row_without_a_conflict_and_a_past_one_is_forgotten(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    table = FakeTable()
    table.rows["A"] = to_row(NodeState(name="A", instance="old"), (), "http://10.0.0.9:11434")  # its last run's
    table.ages["A"] = 1.0
    peers = DatabasePeers(table, "A", lambda now: (NodeState(name="A", instance="new"), ()), interval=1.0, stale_after=5.0)
    peers.listening("http://10.0.0.1:11434")
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.run)
        for _ in range(3):
            await peers.rounds.wait()
        assert peers.conflict == ""
        table.rows["A"] = to_row(NodeState(name="A", instance="other"), (), "http://10.0.0.2:11434")  # another node, once
        await peers.rounds.wait()
        await peers.rounds.wait()
        assert "written at http://10.0.0.2:11434" in peers.conflict
        for _ in range(4):  # the row holds this node's writes again, but not yet for stale_after
            await peers.rounds.wait()
        assert peers.conflict
        for _ in range(3):
            await peers.rounds.wait()
        assert peers.conflict == ""
        nursery.cancel_scope.cancel()
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 1
