"""The other nodes' states through the shared database (``TRIOSHED_DATABASE``, PostgreSQL).

Where a node has the team's database and the fleet secret but no ``TRIOSHED_PEERS``, each node
writes its own state (:func:`trioshed.fleet.state.to_json`) to the ``fleet_nodes`` table every
interval, with the URL the other nodes reach it at, and reads every other node's row in the same
transaction. Relays still go over HTTP(S) to that URL, signed, as with a static list
(:mod:`trioshed.fleet.peers`); only the discovery and the states travel through the database.

**Freshness is the database's clock.** A row carries when it was written by the database's clock
and is read back with its age by the same clock, so nodes whose clocks disagree still agree on
which states are fresh; the reader files the state as received ``age`` seconds before its own
now. A row older than ``stale_after`` is stale: shown unreachable, routed nothing. A row not
written for :data:`FORGET_AFTER` (a node that died without stopping) is removed by the next
node that reads.

**A node's life in the table.** It writes its row only once it listens (:meth:`DatabasePeers.listening`:
until then another node would relay to a port nobody answers), marks itself draining through its
state while it drains (within one interval), and removes its row on a clean stop.

**Every node needs its own name.** Rows are kept by name, so two nodes given the same name would
write one row in turn, each unseen by the other. A node finds this out by reading its own row
before it writes it: once its write went through, any other content there was written by another
node under its name. It logs that once, at ERROR, and shows it in the fleet's view
(:attr:`DatabasePeers.conflict`). Its own row left by its previous run (a restart) is no sign of
it: that is only judged after a first write.

**The database is never waited on by the event loop, and its outage stops nothing.** Each
exchange runs in a worker thread, one at a time, bounded by the store's connect timeout. On a
fault the peers keep their last state until it goes stale, the fault is logged once per cause,
and the next interval tries again. The store's own connection pool is this source's alone, so
a slow usage write never delays the fleet's view.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol
from urllib.parse import urlsplit

import trio
from trio_util import RepeatedEvent

from trioshed.core.addresses import node_url
from trioshed.core.route import NodeState
from trioshed.fleet.peers import Peer
from trioshed.fleet.state import DeviceView, LocalNode, from_json, to_json
from trioshed.usage.recorder import describe
from trioshed.usage.store import StoreError

log = logging.getLogger(__name__)

#: A row not written for this long is removed: its node died without stopping (an hour in the
#: fleet's view as unreachable first, for whoever looks).
FORGET_AFTER = 3600.0



class FleetTable(Protocol):
    """The table of the fleet's nodes (:class:`trioshed.usage.pg.PgStore` implements it). Blocking."""

    where: str  # the database, without its password: for logs

    def exchange(self, me: str, mine: tuple[str, str] | None, forget_after: float) -> list[tuple[str, str, str, float]]:
        """Read every row as (name, URL, state, age), ``me``'s as it was before this call; then
        write ``me``'s (URL, state), if given."""
        ...

    def withdraw(self, me: str) -> None: ...
    def close(self) -> None: ...


def to_row(node: NodeState, devices: tuple[DeviceView, ...], url: str) -> tuple[str, str]:
    """What a node writes to its row: its URL and its state's wire form as JSON."""
    return url, json.dumps(to_json(node, devices), separators=(",", ":"))


def from_row(name: str, url: str, text: str, age: float, now: float, stale_after: float) -> Peer:
    """Another node's row read back at ``now`` (the reader's clock), ``age`` seconds old by the
    database's clock: a :class:`Peer` seen at ``now - age``, unreachable when stale. ValueError
    when the row is not a node's state (a bad URL, a port out of range included, not JSON,
    another version, another name): the reader shows that node unreachable and routes it nothing."""
    try:
        node_url(url, port_required=True)
    except ValueError:
        raise ValueError(f"not a node's URL: {url[:200]!r}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"its state is not JSON: {exc}") from None
    state, devices = from_json(data, url, now - age)
    if state.name != name:
        raise ValueError(f"its row holds the state of {state.name!r}")
    return judged(Peer(url, state, devices), now, stale_after)


def judged(peer: Peer, now: float, stale_after: float, down: str = "") -> Peer:
    """``peer`` as routing may use it at ``now``: unreachable when its state is older than
    ``stale_after``, or when ``down`` says why (a relay found it dead)."""
    age = now - peer.state.seen
    if age > stale_after:
        error = f"its state is {age:.0f} s old (stale after {stale_after:g} s)"
    elif down:
        error = down
    else:
        return peer if peer.state.reachable else replace(peer, state=replace(peer.state, reachable=True), error="")
    return replace(peer, state=replace(peer.state, reachable=False), error=error)


class DatabasePeers:
    """The fleet's nodes as the shared database holds them (see the module docstring).

    ``state``: this node's state and devices now (called on the Trio thread before each write);
    ``url``: where the other nodes reach this node (None: the address it listens on, once it does).
    """

    def __init__(
        self,
        table: FleetTable,
        name: str,
        state: Callable[[float], tuple[NodeState, tuple[DeviceView, ...]]],
        *,
        interval: float,
        stale_after: float,
        url: str | None = None,
    ) -> None:
        self.table = table
        self.name = name
        self.state = state
        self.interval = interval
        self.stale_after = stale_after
        self.url = url
        self.listens = False  # rows are written from the first round after this node listens
        self.written = False  # whether this node's row is in the table (removed on a clean stop)
        self.problem = ""  # the database's fault at the last exchange ("" when none)
        self._read: dict[str, Peer] = {}  # every other node's row as read, by name
        self._unusable: set[str] = set()  # the rows among them that hold no state this node reads
        self._down: dict[str, tuple[float, str]] = {}  # name -> (until when, why): a relay found it dead
        self._view: tuple[Peer, ...] = ()
        self._written: tuple[str, str] | None = None  # the row this node last wrote, known written
        self.conflict = ""  # why another node seems to write this node's row ("" when none does)
        self._conflict_seen = 0.0
        self.rounds = RepeatedEvent()  # set after each exchange, done or failed (tests wait on it)

    def peers(self) -> tuple[Peer, ...]:
        return self._view

    def mark_down(self, name: str, reason: str) -> None:
        """Route nothing to ``name`` for ``stale_after`` seconds: its row says it is alive, but
        this node could not reach it at its URL (a fresh row is no proof of that)."""
        now = trio.current_time()
        self._down[name] = (now + self.stale_after, reason)
        self._judge(now)

    def listening(self, url: str) -> None:
        """This node listens at ``url`` now: its row may be written (at ``url`` when no URL was given)."""
        if self.url is None:
            self.url = url
        self.listens = True
        if _loopback(self.url) and not _loopback(self.table.where):
            log.warning(
                "fleet: this node is at %s for the other nodes, a loopback address only nodes on this machine reach; "
                "set TRIOSHED_FLEET_URL (or TRIOSHED_HOST) to an address they reach", self.url,
            )  # fmt: skip
        else:
            log.info("fleet: this node is at %s for the other nodes (in the database %s)", self.url, self.table.where)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: exchange rows every interval; at the end, remove this node's row.

        Cancellation: an exchange in its worker thread is waited for (the store's connect
        timeout bounds it); the row's removal is shielded and bounded the same way."""
        task_status.started()
        try:
            while True:
                await self._exchange()
                self.rounds.set()
                await trio.sleep(self.interval)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._stop)

    async def _exchange(self) -> None:
        mine = None
        if self.listens and self.url is not None:
            mine = to_row(*self.state(trio.current_time()), self.url)
            self.written = True  # removed at the stop even if this write's answer is lost
        try:
            rows = await trio.to_thread.run_sync(self.table.exchange, self.name, mine, FORGET_AFTER)
        except StoreError as exc:
            self._written = None  # it may have been written all the same: not judged next time
            self._fault(exc)
            self._judge(trio.current_time())
            return
        own = next(((url, text) for name, url, text, _ in rows if name == self.name), None)
        self._check_own(own, trio.current_time())
        self._written = mine
        if self.problem:
            log.info("fleet: the database %s answers again", self.table.where)
            self.problem = ""
        now = trio.current_time()
        read: dict[str, Peer] = {}
        unusable: set[str] = set()
        for name, url, text, age in rows:
            if name == self.name:
                continue
            try:
                read[name] = from_row(name, url, text, age, now, self.stale_after)
            except ValueError as exc:
                unusable.add(name)
                if name not in self._unusable:  # logged once, not every interval
                    log.warning("fleet: node %s's row in the database is not usable: %s", name, exc)
                read[name] = Peer(url, NodeState(name=name, url=url, reachable=False), error=str(exc))
                continue
            if name not in self._read:
                log.info("fleet: node %s (%s) joined", name, url)
        for name in self._read.keys() - read.keys():
            log.info("fleet: node %s left", name)
        self._read, self._unusable = read, unusable
        self._judge(now)

    def _check_own(self, own: tuple[str, str] | None, now: float) -> None:
        """This node's row as read before this write (``own``), against what it last wrote; a
        conflict is forgotten once the row has held this node's writes for ``stale_after``."""
        if self._written is None:
            return
        if own == self._written:
            if self.conflict and now - self._conflict_seen > self.stale_after:
                log.info("fleet: no other node has written this node's row for %g s", self.stale_after)
                self.conflict = ""
            return
        self._conflict_seen = now
        where = "its row was removed" if own is None else f"its row was written at {own[0]}"
        conflict = (
            f"another node seems to have this node's name {self.name!r} ({where}, not by this node); "
            "every node needs its own TRIOSHED_NODE_NAME"
        )
        if not self.conflict:  # once, when it starts (its details change as the rows do)
            log.error("fleet: %s", conflict)
        self.conflict = conflict

    def _judge(self, now: float) -> None:
        self._down = {n: d for n, d in self._down.items() if d[0] > now and n in self._read}
        self._view = tuple(
            p if n in self._unusable else judged(p, now, self.stale_after, self._down.get(n, (0.0, ""))[1])
            for n, p in sorted(self._read.items())
        )

    def _fault(self, exc: BaseException) -> None:
        problem = describe(exc)
        if problem != self.problem:
            log.warning(
                "fleet: the database %s %s: the other nodes keep their last state until it is %g s old; trying again every %g s",
                self.table.where, problem, self.stale_after, self.interval,
            )  # fmt: skip
        self.problem = problem

    def _stop(self) -> None:
        """Remove this node's row (a clean stop: the others see it gone at their next reading)
        and close the store (blocking: a worker thread)."""
        try:
            if self.written:
                self.table.withdraw(self.name)
                log.info("fleet: node %s removed from the database", self.name)
        except StoreError as exc:
            log.warning("fleet: could not remove node %s from the database %s (%s): it goes stale there", self.name, self.table.where, exc)
        finally:
            self.table.close()


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost" or host.startswith("/")  # a unix socket: this machine


def state_of(local: LocalNode) -> Callable[[float], tuple[NodeState, tuple[DeviceView, ...]]]:
    """``local``'s state and devices at a time."""
    return lambda now: (local.state(now), local.slow.devices)
