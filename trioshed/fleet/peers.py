"""Where the other nodes' states come from.

:class:`StateSource` is the small interface the fleet reads: the peers as last seen, and a way
to say that one was found dead between two readings. :class:`StaticPeers` implements it over a
static list of URLs (``TRIOSHED_PEERS``), polling each node's ``GET /api/fleet/state``, signed
(:mod:`trioshed.fleet.auth`), every ``interval`` seconds; :class:`~trioshed.fleet.dbpeers.DatabasePeers` over the
shared database (each node writing its state to a table, every node reading the others').

A node finds itself in the list by its name and its run's token (every node may be given the same
list) and skips it. **Every node needs its own name**: a node that answers with this node's name
but another token, or with the name of another node of the list, is routed nothing, with an error
that says so in the fleet's view (and the log, once); the first of the list keeps the name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import trio
from trio_util import RepeatedEvent

from trioshed.core.route import NodeState
from trioshed.fleet.auth import FleetAuth, body_digest
from trioshed.fleet.state import DeviceView, from_json

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

STATE_PATH = "/api/fleet/state"
_NO_BODY = body_digest(b"")


@dataclass(frozen=True)
class Peer:
    """Another node as last seen: its state (``reachable`` False after a failed reading or
    relay; its name is its URL until it answered once), its devices, and what went wrong."""

    url: str
    state: NodeState
    devices: tuple[DeviceView, ...] = ()
    error: str = ""


class StateSource(Protocol):
    """The other nodes' states, as this node's fleet reads them."""

    def peers(self) -> tuple[Peer, ...]:
        """Every other node, as last seen (reachable or not)."""
        ...

    def mark_down(self, name: str, reason: str) -> None:
        """A relay found node ``name`` dead: route nothing to it until it answers again."""
        ...

    def listening(self, url: str) -> None:
        """This node takes requests at ``url`` now (the first address it listens on)."""
        ...

    @property
    def conflict(self) -> str:
        """Why another node seems to carry this node's name ("" when none does)."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the states current until cancelled."""
        ...


class StaticPeers:
    """The peers of ``TRIOSHED_PEERS``, polled over HTTP (see the module docstring)."""

    def __init__(
        self, urls: tuple[str, ...], auth: FleetAuth, self_name: str, client: httpx.AsyncClient, *, interval: float,
        self_instance: str = "",
    ) -> None:  # fmt: skip
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.auth = auth
        self.self_name = self_name
        self.self_instance = self_instance  # this node's run (NodeState.instance)
        self.client = client
        self.interval = interval
        self._peers: dict[str, Peer] = {url: Peer(url, NodeState(name=url, url=url, reachable=False), error="not read yet") for url in self.urls}
        self._self_urls: set[str] = set()
        self._view: tuple[Peer, ...] = ()
        self._named_twice: set[str] = set()  # the URLs logged for a name another node has
        self.conflict = ""
        self.rounds = RepeatedEvent()  # set after each round of readings (tests wait on it)
        self._judge()

    def peers(self) -> tuple[Peer, ...]:
        return self._view

    def mark_down(self, name: str, reason: str) -> None:
        for url, peer in self._peers.items():
            if peer.state.name == name:
                self._peers[url] = replace(peer, state=replace(peer.state, reachable=False), error=reason)
        self._judge()

    def _judge(self) -> None:
        """The peers as routing may use them: a node answering with a name that this node or a
        node before it in the list has is routed nothing (see the module docstring)."""
        view: list[Peer] = []
        names = {self.self_name}
        conflict = ""
        for url, peer in self._peers.items():
            if url in self._self_urls:
                continue
            name = peer.state.name
            if name in names and name != url:
                error = f"another node answers as {name!r} too; every node needs its own TRIOSHED_NODE_NAME"
                if name == self.self_name:
                    conflict = f"the node at {url} answers with this node's name {name!r}; every node needs its own TRIOSHED_NODE_NAME"
                if url not in self._named_twice:
                    self._named_twice.add(url)
                    log.error("fleet: the node at %s answers as %r, a name another node has: it is routed nothing; "
                              "give every node its own TRIOSHED_NODE_NAME", url, name)  # fmt: skip
                peer = replace(peer, state=replace(peer.state, reachable=False), error=error)
            elif peer.state.reachable:
                names.add(name)
                self._named_twice.discard(url)
            view.append(peer)
        self._view = tuple(view)
        self.conflict = conflict

    def listening(self, url: str) -> None:
        pass  # the other nodes find this one in their own lists

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            async with trio.open_nursery() as nursery:
                for url in self.urls:
                    if url not in self._self_urls:
                        nursery.start_soon(self._read, url)
            self._judge()
            self.rounds.set()
            await trio.sleep(self.interval)

    async def _read(self, url: str) -> None:
        import httpx  # the client's errors: httpx is imported by build_fleet, only in a fleet

        old = self._peers[url]
        # signed for the node last read there (any node before a first answer, or after a failure)
        to = old.state.name if old.state.reachable and old.state.name != url else ""
        try:
            with trio.fail_after(max(1.0, 2 * self.interval)):
                headers = self.auth.sign("GET", STATE_PATH, _NO_BODY, to=to, key=None)
                response = await self.client.get(url + STATE_PATH, headers=headers)
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}")
            state, devices = from_json(response.json(), url, trio.current_time())
        except (httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
            error = _describe(exc)
            if old.state.reachable or old.error != error:
                log.warning("fleet: node %s is unreachable: %s", url, error)
            self._peers[url] = replace(old, state=replace(old.state, reachable=False), error=error)
            return
        if state.name == self.self_name and (not state.instance or state.instance == self.self_instance):
            self._self_urls.add(url)  # this node itself, in a list shared by every node
            return
        if not old.state.reachable and old.error != "not read yet":
            log.info("fleet: node %s (%s) answers again", state.name, url)
        self._peers[url] = Peer(url, state, devices)


def _describe(exc: BaseException) -> str:
    """What went wrong, in the words of the first error in the chain that has some (httpx's
    ConnectError has none of its own for a certificate that does not verify: its cause does)."""
    seen: BaseException | None = exc
    while seen is not None:
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__
