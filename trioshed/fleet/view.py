"""The fleet as one: every node's memory, runners, queue and reachability, and the models only
other nodes hold, for ``/api/ps``, ``/api/tags``, ``/v1/models`` and the status page.

Plain data from what the fleet already holds (this node's state now, the peers' as last read):
asking for the view reaches no other node.
"""

from __future__ import annotations

from typing import Any

from trioshed.core.route import NodeState
from trioshed.fleet.node import Fleet
from trioshed.fleet.state import DeviceView


def node_entry(node: NodeState, devices: tuple[DeviceView, ...], *, url: str, error: str, age: float | None) -> dict[str, Any]:
    """One node as the view shows it."""
    return {
        "name": node.name,
        "url": url,
        "reachable": node.reachable,
        "error": error,
        "age": None if age is None else round(age, 3),  # seconds since its state was read (None: this node)
        "draining": node.draining,
        "queued": node.queued,
        "runners": node.runners,
        "max_runners": node.max_runners,
        "room": node.room,
        "models": len(node.models),
        "loaded": [
            {"model": m, "slots": x.slots, "busy": x.busy, "queued": x.queued, "context": x.context, "ready": x.ready}
            for m, x in sorted(node.loaded.items())
        ],
        "devices": [{"id": d.id, "total": d.total, "free": d.free, "used": d.used} for d in devices],
    }


def nodes(fleet: Fleet, now: float, *, ages: bool = True) -> list[dict[str, Any]]:
    """This node first, then every peer (reachable or not), as last seen; ``ages``: with how old
    each reading is (the status page leaves them out: its state message is sent on changes)."""
    local = fleet.local
    out = [node_entry(local.state(now), local.slow.devices, url="", error=fleet.source.conflict, age=None)]
    for peer in fleet.peers():
        age = now - peer.state.seen if peer.state.seen and ages else None
        out.append(node_entry(peer.state, peer.devices, url=peer.url, error=peer.error, age=age))
    return out


def models_elsewhere(fleet: Fleet, here: set[str]) -> dict[str, tuple[int, list[str]]]:
    """The models other (reachable) nodes hold and this node's store does not: name -> (the
    bytes it needs by the first holder's estimate, the nodes holding it)."""
    out: dict[str, tuple[int, list[str]]] = {}
    for peer in fleet.peers():
        if not peer.state.reachable:
            continue
        for name, need in peer.state.models.items():
            if name in here:
                continue
            size, holders = out.get(name, (need, []))
            out[name] = (size, [*holders, peer.state.name])
    return out
