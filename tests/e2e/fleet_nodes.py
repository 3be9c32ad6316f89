"""Three trioshed nodes on loopback forming a fleet, for the fleet's end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trioshed.server import Server
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server

SECRET = "fleet-test-secret"


@dataclass
class Node:
    name: str
    server: Server
    record: list[tuple[str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.base_url

    def dispatches(self, model: str) -> int:
        """Requests this node's own runners were given for ``model``."""
        return self.record.count(("dispatch", model))

    def loads(self) -> int:
        return self.server.scheduler.statistics().loads


async def wait_until(check: Callable[[], bool], observer: Node) -> None:
    """Until ``check()`` holds, looking again after each round of ``observer``'s readings of the
    other nodes (every 0.1 s in these tests); the test's own deadline bounds it."""
    fleet = observer.server.state.fleet
    assert fleet is not None
    rounds = fleet.source.rounds  # type: ignore[attr-defined]
    while not check():
        await rounds.wait()


def sees(observer: Node, other: Node, model: str | None = None) -> bool:
    """Whether ``observer`` has a fresh reading of ``other`` (with ``model`` loaded, if given)."""
    fleet = observer.server.state.fleet
    assert fleet is not None
    for peer in fleet.peers():
        if peer.state.name == other.name and peer.state.reachable:
            return model is None or model in peer.state.loaded
    return False


@asynccontextmanager
async def open_fleet(
    stores: Sequence[Path], names: Sequence[str] = ("A", "B", "C"), *, peers_extra: tuple[str, ...] = (), **overrides: object
) -> AsyncIterator[list[Node]]:
    """One node per name, each with its store (one store for all when one is given), each
    knowing every node's URL (its own included, and ``peers_extra``: nodes started apart), with
    fresh readings of each other at yield."""
    ports = [free_port() for _ in names]
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports) + peers_extra
    settings = {"peers": urls, "fleet_secret": SECRET, "fleet_interval": 0.1, "fleet_stale": 2.0, **overrides}
    async with AsyncExitStack() as stack:
        nodes: list[Node] = []
        for i, (name, port) in enumerate(zip(names, ports, strict=True)):
            record: list[tuple[str, str]] = []
            store = stores[i if len(stores) > 1 else 0]
            server = await stack.enter_async_context(open_test_server(store, record=record, port=port, node_name=name, **settings))
            nodes.append(Node(name, server, record))
        for node in nodes:
            await wait_until(lambda node=node: all(sees(node, b) for b in nodes if b is not node), node)  # type: ignore[misc]
        yield nodes
