"""This node's part in a fleet: where each request goes, and sending it there.

:class:`Fleet` is built by ``serve()`` when ``TRIOSHED_FLEET_SECRET`` is set. For each generating
or embedding request, the request preamble (:func:`trioshed.api.pipeline.preamble.prepare`, where the model
is resolved) asks :meth:`Fleet.route`, which gathers this node's state and the peers' and asks the
pure decision (:func:`trioshed.core.route.choose`); a request better served elsewhere raises
:class:`Forward`, which the HTTP edge turns into a relay (:meth:`Fleet.relay`). A request that
was forwarded here, or sent back here after every node it was sent to failed, is served here.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio
from trio_util import RepeatedEvent

from trioshed.core.model import ModelSpec
from trioshed.core.route import Choice, NodeState, PrefixTable, choose, prefix_key
from trioshed.fleet.auth import FleetAuth, body_digest, serve_here
from trioshed.fleet.peers import Peer, StateSource
from trioshed.fleet.relay import Relayed, Target, forward_headers, open_relay
from trioshed.fleet.state import LocalNode
from trioshed.keys import ApiKey
from trioshed.runner.client import ConnectionFailed, UpstreamPool

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)


class Forward(Exception):  # not an error: a request the fleet sends elsewhere
    """The request is better served by another node: ``targets`` in order (then this node)."""

    def __init__(self, model: str, choice: Choice, targets: tuple[Target, ...]) -> None:
        super().__init__(f"{model} -> {choice.node} ({choice.reason})")
        self.model = model
        self.choice = choice
        self.targets = targets


def routable(peers: Sequence[Peer]) -> dict[str, str]:
    """Where each node's name is reached: reachable peers only, and for a name two peers answer
    with, the first one's (the one routing reads: never the second's traffic)."""
    urls: dict[str, str] = {}
    for peer in peers:
        if peer.state.reachable:
            urls.setdefault(peer.state.name, peer.url)
    return urls


def canonical(name: str) -> str:
    """A model name as stores list it: ``m`` is ``m:latest``."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class Fleet:
    """This node's view of the fleet and its way to the other nodes."""

    def __init__(
        self,
        local: LocalNode,
        source: StateSource,
        auth: FleetAuth,
        client: httpx.AsyncClient,
        *,
        interval: float,
        stale_after: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.local = local
        self.ssl_context = ssl_context  # for nodes reached over https:// (None: the system's CAs)
        self.source = source
        self.auth = auth
        self.client = client
        self.interval = interval
        self.stale_after = stale_after
        self.routed = PrefixTable()  # where this node sent each conversation
        #: (node, model) -> when each request this node sent there (still in flight) started
        self._inflight: dict[tuple[str, str], list[float]] = {}
        self._pools: dict[str, UpstreamPool] = {}
        self.sending = RepeatedEvent()  # set as each request is sent on (tests wait on it)
        self.counts: Counter[str] = Counter()  # forwarded, served_for_peer, relay_failed, ran_here_after_failure

    @property
    def name(self) -> str:
        return self.local.name

    def nodes(self, now: float) -> list[NodeState]:
        """This node (now) and the peers (as last seen)."""
        return [self.local.state(now), *(p.state for p in self.source.peers())]

    def peers(self) -> tuple[Peer, ...]:
        return self.source.peers()

    def route(self, name: str, spec: ModelSpec | None, body: Mapping[str, Any], *, embedding: bool = False) -> None:
        """Return when this node serves the request for model ``name`` (``spec``: the local
        store's entry, None when the local store has none); raise :class:`Forward` when another
        node serves it better."""
        now = trio.current_time()
        prefix = None if embedding else prefix_key(body)
        if serve_here.get():
            if prefix is not None:
                self.local.served.note(prefix, self.name, now)
            return
        model = spec.name if spec is not None else canonical(name)
        nodes = self.nodes(now)
        choice = choose(
            model, nodes, local=self.name, now=now, stale_after=self.stale_after, prefix=prefix,
            routed=self.routed.owner(prefix, now) if prefix else None, pending=self.pending(nodes),
        )  # fmt: skip
        if prefix is not None:
            self.routed.note(prefix, choice.node, now)
        if choice.node == self.name:
            if prefix is not None:
                self.local.served.note(prefix, self.name, now)
            return
        urls = routable(self.source.peers())
        names = [choice.node, *itertools.takewhile(lambda n: n != self.name, choice.then)]
        raise Forward(model, choice, tuple(Target(n, urls[n]) for n in names if n in urls))

    def pool(self, url: str) -> UpstreamPool:
        """The keep-alive connections to the node at ``url`` (trioshed's own HTTP/1.1 client:
        httpx costs a third of a relayed request's CPU; see ``trioshed.runner.client``), over TLS
        for an ``https://`` URL, verified against :attr:`ssl_context`. ConnectionFailed for a URL
        no connection can be made to (a port out of range: a bad row of the database)."""
        pool = self._pools.get(url)
        if pool is None:
            try:
                parts = urlsplit(url)  # http://[::1]:port too: the host without its brackets
                tls = parts.scheme == "https"
                host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
            except ValueError as exc:
                raise ConnectionFailed(f"{url[:200]!r} is no node's URL: {exc}") from None
            context = (self.ssl_context or ssl.create_default_context()) if tls else None
            pool = self._pools[url] = UpstreamPool(
                port, host=host, max_idle=64, connect_timeout=3.0, streams_keep_alive=True, ssl_context=context
            )  # fmt: skip
        return pool

    def inflight(self, node: str) -> int:
        """Requests this node has sent to ``node`` whose answers are still being relayed."""
        return sum(len(starts) for (name, _), starts in self._inflight.items() if name == node)

    def pending(self, nodes: Sequence[NodeState]) -> dict[tuple[str, str], int]:
        """Requests sent to each (node, model) since that node's state was read."""
        seen = {n.name: n.seen for n in nodes}
        return {k: sum(1 for t in starts if t >= seen.get(k[0], 0.0)) for k, starts in self._inflight.items() if starts}

    async def relay(
        self, forward: Forward, key: ApiKey | None, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> Relayed | None:
        """Send the request on (:func:`trioshed.fleet.relay.open_relay`), signed for each node it
        is tried on, with the name of its key (``key`` None: no key); None when every target
        failed before answering (then this node serves it). The request counts as in flight on
        its node until the answer is closed."""
        kind, kept = forward_headers(headers)
        digest = body_digest(body)  # once, whichever nodes it is tried on
        name = key.name if key is not None else None
        for target in forward.targets:
            started = trio.current_time()
            slot = self._inflight.setdefault((target.name, forward.model), [])
            slot.append(started)
            self.sending.set()
            sent = [*kept, *self.auth.sign(method, path, digest, to=target.name, key=name).items()]
            try:
                relayed = await open_relay(self.pool(target.url), target, method, path, kind, sent, body)
            except ConnectionFailed as exc:
                log.warning("fleet: node %s failed before answering (%s); trying the next", target.name, exc)
                self.source.mark_down(target.name, str(exc))
                relayed = None
            except BaseException:
                slot.remove(started)
                raise
            if relayed is None:
                slot.remove(started)
                self.counts["relay_failed"] += 1
                continue
            self.counts["forwarded"] += 1
            log.debug("fleet: %s %s for %s -> %s (%s)", method, path, forward.model, target.name, forward.choice.reason)
            if relayed.whole:
                slot.remove(started)
            else:
                relayed.on_close = lambda slot=slot, started=started: slot.remove(started)  # type: ignore[misc]
            return relayed
        self.counts["ran_here_after_failure"] += 1
        return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: this node's slow state refreshed, the peers read, every interval."""
        try:
            await trio.to_thread.run_sync(self.local.refresh, self.local.stats())
            async with trio.open_nursery() as nursery:
                await nursery.start(self.source.run)
                task_status.started()
                while True:
                    await trio.sleep(self.interval)
                    await trio.to_thread.run_sync(self.local.refresh, self.local.stats())
        finally:
            with trio.move_on_after(1, shield=True):
                for pool in self._pools.values():
                    await pool.aclose()
                await self.client.aclose()

