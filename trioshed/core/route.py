"""Which node of a fleet serves a request: a pure decision over the nodes' published states.

Every node of a fleet takes any request and asks :func:`choose` where it is best served; the
node's own HTTP edge (:mod:`trioshed.fleet`) and the 100-node simulation (``bench/fleet_sim.py``)
call the same function. The shape is the one inference routers share (llm-d's endpoint picker,
GPUStack's scheduler: filter, then score, then pick), with the order of preference that
paddler's slot-aware balancing and a model scheduler's loads suggest:

1. **Filter**: nodes whose state is fresh (seen within ``stale_after`` seconds; the local node
   always is), reachable, not draining, and whose store holds the model.
2. **Prefix**: a conversation goes back to the node that served its prompt prefix (its
   llama-server still holds the prompt in its cache) while the model is warm there and the node
   is not overloaded (fewer than ``OVERLOAD`` requests per slot, queued ones included).
3. **Warm**: the node with the model loaded and the lightest load (busy + queued slots over
   slots; the local node first on a tie: no hop), if it has a free slot.
4. **Spread**: every warm node's queue so long that its last request would wait longer than a
   load takes (requests per slot beyond the running one times :data:`ANSWER_SECONDS`, against
   :func:`load_seconds` of the model's estimate): a node where the model fits without evicting
   anything (its own estimate against its room) loads a copy, else, when the queue would wait
   longer than two loads (this one and the evicted model's reload), one that makes room by
   evicting only idle runners. Until then the warm node serves it, queue and all.
5. **Busy warm**: else the warm node with the shortest queue.
6. **Fits**: not loaded anywhere: a node where it fits without evicting (the local node first).
7. **Evicts idle**: a node that makes room by evicting only idle runners (the local node first).
8. **Local**: else the local node under its own scheduling policy (it evicts, or queues),
   or, when its store lacks the model, the node with the shortest queue that has it.

Where a copy is loaded (4, 6) every node ranks the candidates in the same order, a hash of the
model and the node's name (rendezvous hashing), so that nodes reading the same states while a
burst arrives load one copy on one node, not one copy each.

``pending`` counts the requests this node has sent to a node since that node's state was
published (they are in nobody's published numbers yet), so that a burst arriving between two
polls spreads instead of piling onto one node, and ties are broken in an order of each deciding
node's own, so that nodes reading the same states do not all pick the same one. No I/O, no
clock: ``now`` is passed in.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

#: Requests per slot (running and queued) above which a node no longer takes a conversation back.
OVERLOAD = 2.0
#: Seconds a typical answer holds a slot: a queue of ``q`` requests per slot makes the last of
#: them wait about ``q * ANSWER_SECONDS``.
ANSWER_SECONDS = 2.0
#: What a load costs, by the model's own estimate: ``LOAD_SECONDS + bytes / LOAD_BYTES_PER_SECOND``
#: (a runner's start, then its weights read and copied to the device).
LOAD_SECONDS = 2.0
LOAD_BYTES_PER_SECOND = 1024**3
#: Bytes of a conversation's start that identify it (its first messages, its system prompt).
PREFIX_BYTES = 1024


@dataclass(frozen=True)
class ModelLoad:
    """One model loaded on a node, its runners together."""

    slots: int  # parallel slots over its runners
    busy: int = 0  # slots serving a request
    queued: int = 0  # requests waiting for one of its slots
    context: int = 0  # the largest context among its runners
    ready: bool = True  # False while its only runner is loading


@dataclass(frozen=True)
class NodeState:
    """What a node publishes about itself (``GET /api/fleet/state``), as another node last saw it."""

    name: str  # unique in the fleet
    url: str = ""  # where other nodes reach it ("" for the node itself)
    #: The models in its store, each with the bytes it needs by the node's own estimate.
    models: Mapping[str, int] = field(default_factory=dict)
    loaded: Mapping[str, ModelLoad] = field(default_factory=dict)
    room: int = 0  # bytes a new runner can take without evicting anything (largest device)
    runners: int = 0
    max_runners: int = 3
    queued: int = 0  # requests waiting on the node, all models
    draining: bool = False
    prefixes: Set[str] = frozenset()  # prompt prefixes it served recently
    seen: float = 0.0  # when this state was received (the deciding node's clock)
    reachable: bool = True
    #: A token drawn when the node started: tells a node reading its own name apart from
    #: another node given the same name ("" from a node that sends none).
    instance: str = ""

    def fits(self, model: str) -> bool:
        """Whether a runner of ``model`` can start here without evicting anything."""
        need = self.models.get(model)
        return need is not None and need <= self.room and self.runners < self.max_runners

    def makes_room(self, model: str) -> bool:
        """Whether a runner of ``model`` can start here by evicting only idle runners (nothing
        running or queued on them)."""
        need = self.models.get(model)
        if need is None:
            return False
        idle = [m for m, x in self.loaded.items() if x.ready and not x.busy and not x.queued]
        freed = sum(self.models.get(m, 0) for m in idle)
        return need <= self.room + freed and self.runners - len(idle) < self.max_runners


@dataclass(frozen=True)
class Choice:
    """Where a request goes: ``node`` (a :attr:`NodeState.name`), why, and where it goes next if
    that node dies before answering (best first)."""

    node: str
    reason: str
    then: tuple[str, ...] = ()


def loaded_on(node: NodeState, model: str, pending: int = 0) -> ModelLoad | None:
    """``model`` on ``node`` as published, or, where this node has sent it requests since the
    state was published, as a runner being loaded there (one slot): it is warm from then on."""
    loaded = node.loaded.get(model)
    if loaded is None and pending:
        return ModelLoad(slots=1, ready=False)
    return loaded


def load_of(node: NodeState, model: str, pending: int = 0) -> float:
    """Requests per slot for ``model`` on ``node``: running, queued and sent-but-unpublished."""
    loaded = loaded_on(node, model, pending)
    if loaded is None:
        return float("inf")
    return (loaded.busy + loaded.queued + pending) / max(1, loaded.slots)


def load_seconds(need: int) -> float:
    """How long loading a model that needs ``need`` bytes takes, about."""
    return LOAD_SECONDS + need / LOAD_BYTES_PER_SECOND


def queue_pays(load: float, need: int, loads: int = 1) -> bool:
    """Whether a queue of ``load`` requests per slot (running ones included) waits longer than
    ``loads`` loads of a model that needs ``need`` bytes take: only then does a copy elsewhere
    serve the queue sooner than the warm node does."""
    return (load - 1.0) * ANSWER_SECONDS > loads * load_seconds(need)


def choose(
    model: str,
    nodes: Iterable[NodeState],
    *,
    local: str,
    now: float,
    stale_after: float,
    prefix: str | None = None,
    routed: str | None = None,
    pending: Mapping[tuple[str, str], int] | None = None,
) -> Choice:
    """Where a request for ``model`` is best served (see the module docstring).

    ``local``: the deciding node's name; ``prefix``: the request's :func:`prefix_key` (None:
    none); ``routed``: the node this node last sent that prefix to, if remembered
    (:class:`PrefixTable`); ``pending``: (node, model) -> requests sent there since its state
    was published.
    """
    pending = pending or {}
    eligible = [
        n for n in nodes
        if (n.name == local or (n.reachable and now - n.seen <= stale_after))
        and not n.draining and model in n.models
    ]  # fmt: skip
    if not eligible:
        return Choice(local, "no other node has it")

    def load(n: NodeState) -> float:
        return load_of(n, model, pending.get((n.name, model), 0))

    def rank(n: NodeState) -> tuple[float, bool, int]:
        return (load(n), n.name != local, _order(local, n.name))

    warm = sorted((n for n in eligible if loaded_on(n, model, pending.get((n.name, model), 0))), key=rank)
    warm_names = {n.name for n in warm}

    def then(first: str) -> tuple[str, ...]:
        rest = [n for n in warm if n.name != first] + [n for n in eligible if n.name != first and n.name not in warm_names]
        ordered = sorted(rest, key=lambda n: n.name != local)  # the local node first: no hop
        return tuple(n.name for n in ordered)

    if prefix is not None:
        owner = next((n for n in warm if n.name == routed), None) or next((n for n in warm if prefix in n.prefixes), None)
        if owner is not None and load(owner) < OVERLOAD:
            return Choice(owner.name, "prefix", then(owner.name))
    if warm:
        best = warm[0]
        if load(best) < 1.0:
            return Choice(best.name, "warm", then(best.name))
        need = max((n.models[model] for n in eligible), default=0)
        if queue_pays(load(best), need):
            cold = [n for n in eligible if n.name not in warm_names]
            spare = [n for n in cold if n.fits(model)]
            if not spare and queue_pays(load(best), need, loads=2):
                spare = [n for n in cold if n.makes_room(model)]
            if spare:
                pick = min(spare, key=lambda n: (n.queued, _home(model, n.name)))
                return Choice(pick.name, "spread", then(pick.name))
        calmest = min(warm, key=lambda n: (_queue(n, model, pending), load(n), n.name != local, _order(local, n.name)))
        return Choice(calmest.name, "warm, busy", then(calmest.name))
    fitting = [n for n in eligible if n.fits(model)]
    if fitting:
        pick = min(fitting, key=lambda n: (n.name != local, _home(model, n.name)))
        return Choice(pick.name, "fits", then(pick.name))
    evicting = [n for n in eligible if n.makes_room(model)]
    if evicting:
        pick = min(evicting, key=lambda n: (n.name != local, n.queued, _order(local, n.name)))
        return Choice(pick.name, "evicts idle", then(pick.name))
    here = next((n for n in eligible if n.name == local), None)
    if here is not None:
        return Choice(local, "local policy", then(local))
    pick = min(eligible, key=lambda n: (n.queued, n.name))
    return Choice(pick.name, "only there", then(pick.name))


def _order(local: str, name: str) -> int:
    """Ties between nodes broken in an order of the deciding node's own: nodes that read the
    same (slightly old) states do not all pick the same node."""
    return zlib.crc32(f"{local}>{name}".encode())


def _home(model: str, name: str) -> int:
    """The order in which every node ranks the nodes for loading ``model`` (rendezvous hashing):
    nodes that read the same states while a burst arrives load one copy, on the same node, not
    one copy each."""
    return zlib.crc32(f"{model}@{name}".encode())


def _queue(node: NodeState, model: str, pending: Mapping[tuple[str, str], int]) -> int:
    pend = pending.get((node.name, model), 0)
    loaded = loaded_on(node, model, pend)
    return (loaded.queued if loaded is not None else 0) + pend


def prefix_key(body: Mapping[str, Any]) -> str | None:
    """The request's conversation, as a short hash of its start (None: nothing to continue).

    A chat's messages up to its first user message (the system prompt and the first question:
    the same on every turn), else the system prompt and the prompt's first
    :data:`PREFIX_BYTES`; the model is part of the key."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0)
        start: Any = messages[: first_user + 1]
    else:
        prompt = body.get("prompt", body.get("input"))
        if not isinstance(prompt, str) or not prompt:
            return None
        start = [body.get("system"), prompt[:PREFIX_BYTES]]
    text = json.dumps([body.get("model"), start], sort_keys=True, default=str)[: 2 * PREFIX_BYTES]
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class PrefixTable:
    """Prompt prefixes remembered for ``ttl`` seconds, at most ``capacity`` of them (the oldest
    go first): where this node sent each one, or, for the prefixes it served, its own name."""

    def __init__(self, capacity: int = 4096, ttl: float = 600.0) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def note(self, prefix: str, node: str, now: float) -> None:
        self._entries[prefix] = (node, now + self.ttl)
        self._entries.move_to_end(prefix)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def owner(self, prefix: str, now: float) -> str | None:
        entry = self._entries.get(prefix)
        if entry is None:
            return None
        if entry[1] < now:
            del self._entries[prefix]
            return None
        return entry[0]

    def holding(self, node: str, now: float) -> HeldPrefixes:
        """The prefixes ``node`` holds, as a set read when asked (a node's own state is built per
        request: asking whether it holds one prefix looks up that prefix only)."""
        return HeldPrefixes(self, node, now)

    def held_by(self, node: str, now: float, limit: int = 512) -> frozenset[str]:
        """The prefixes ``node`` holds (newest first, at most ``limit``): what a node publishes."""
        out: list[str] = []
        for prefix, (who, expires) in reversed(self._entries.items()):
            if len(out) >= limit:
                break
            if who == node and expires >= now:
                out.append(prefix)
        return frozenset(out)


class HeldPrefixes(Set[str]):
    """The prefixes a node holds in a :class:`PrefixTable` (:meth:`PrefixTable.holding`): a
    membership test is one lookup; iterating lists them (newest first, as published)."""

    def __init__(self, table: PrefixTable, node: str, now: float) -> None:
        self._table = table
        self._node = node
        self._now = now

    def __contains__(self, prefix: object) -> bool:
        return isinstance(prefix, str) and self._table.owner(prefix, self._now) == self._node

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.held_by(self._node, self._now))

    def __len__(self) -> int:
        return len(self._table.held_by(self._node, self._now))
