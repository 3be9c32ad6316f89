"""A node's state as it publishes it (``GET /api/fleet/state``) and as a peer reads it back.

:class:`LocalNode` assembles this node's :class:`~trioshed.core.route.NodeState`: what is
loaded (slots, busy, queued, context) from the scheduler's snapshot at the moment of asking,
and what changes slowly (the models of its store with the bytes each needs by this node's own
estimate, the room a new runner has without evicting, its devices) from :meth:`LocalNode.refresh`,
which the fleet's poller runs in a worker thread once per interval. :func:`to_json` and
:func:`from_json` are the wire form; a peer's malformed state is a ValueError.
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trioshed.core.route import ModelLoad, NodeState, PrefixTable
from trioshed.core.views import default_max_loaded
from trioshed.devices import DeviceSource
from trioshed.models.stores import Stores
from trioshed.scheduler.stats import SchedulerStatistics

log = logging.getLogger(__name__)

#: The wire format's version: a node reads states of this version only.
VERSION = 1


@dataclass(frozen=True)
class DeviceView:
    """One device of a node, for the fleet's view (``/api/ps``, the status page)."""

    id: str
    total: int
    free: int
    used: int


@dataclass
class Slow:
    """What :meth:`LocalNode.refresh` reads: the store's models and their needs, the room, devices."""

    models: dict[str, int] = field(default_factory=dict)
    room: int = 0
    devices: tuple[DeviceView, ...] = ()


class LocalNode:
    """This node, as it publishes itself."""

    def __init__(
        self,
        name: str,
        stats: Callable[[], SchedulerStatistics],
        store: Stores,
        devices: DeviceSource,
        estimate: Callable[[Any], int],
        *,
        max_loaded_models: int,
        gpu_overhead: int = 0,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.name = name
        self.instance = secrets.token_hex(8)  # this process's run (see NodeState.instance)
        self.stats = stats
        self.store = store
        self.devices = devices
        self.estimate = estimate  # a store entry -> the bytes its runner needs (this node's estimate)
        self.max_runners = default_max_loaded(max_loaded_models, len(devices.gpus))
        self.gpu_overhead = gpu_overhead
        self.draining = draining
        self.served = PrefixTable()  # the conversations served here
        self.slow = Slow()
        self._needs: dict[tuple[str, str, int, float], int] = {}

    def refresh(self, stats: SchedulerStatistics) -> None:
        """Read the store, the estimates and the devices (blocking: run in a worker thread);
        ``stats``: the scheduler's snapshot, taken on the Trio thread."""
        models: dict[str, int] = {}
        needs: dict[tuple[str, str, int, float], int] = {}
        for spec in self.store.list():
            ident = (spec.name, spec.path, spec.size, spec.modified)
            need = self._needs.get(ident)
            if need is None:
                try:
                    need = int(self.estimate(spec))
                except Exception as exc:  # unreadable here: its files' size, the least it needs
                    log.debug("fleet: no estimate for %s (%s): its size stands for it", spec.name, exc)
                    need = spec.size
            needs[ident] = models[spec.name] = need
        self._needs = needs
        used: dict[str, int] = {}
        for r in stats.runners:
            for device_id, nbytes in r.usage:
                used[device_id] = used.get(device_id, 0) + nbytes
        views = []
        room = 0
        gpus = self.devices.poll()
        for d in gpus:
            views.append(DeviceView(d.id, d.total, d.free, used.get(d.id, 0)))
            room = max(room, d.total - self.gpu_overhead - used.get(d.id, 0))
        system = self.devices.system()
        views.append(DeviceView(system.id, system.total, system.free, used.get(system.id, 0)))
        if not gpus:
            room = system.free
        self.slow = Slow(models, max(0, room), tuple(views))

    def state(self, now: float) -> NodeState:
        """This node now: the scheduler's snapshot and the last refresh."""
        stats = self.stats()
        return NodeState(
            name=self.name,
            models=self.slow.models,
            loaded=loaded_of(stats),
            room=self.slow.room,
            runners=len(stats.runners),
            max_runners=self.max_runners,
            queued=stats.queued,
            draining=self.draining(),
            prefixes=self.served.holding(self.name, now),
            seen=now,
            instance=self.instance,
        )


def loaded_of(stats: SchedulerStatistics) -> dict[str, ModelLoad]:
    """The loaded models, each one's runners together, with the requests waiting for them.

    An adapter group's runner serves each of its warm members without a load: each is listed
    with the runner's slots (which the members share), so that other nodes send them here."""
    queued = {q.model: q.waiting for q in stats.queue}
    out: dict[str, ModelLoad] = {}
    for r in stats.runners:
        if r.state == "unloading" or r.evicting:
            continue
        ready = r.state == "ready"
        for name in dict.fromkeys((r.model, *(m.name for m in r.members))):
            old = out.get(name)
            if old is None:
                out[name] = ModelLoad(r.slots, r.leases, queued.get(name, 0), r.context_length, ready)
            else:
                out[name] = ModelLoad(
                    old.slots + r.slots, old.busy + r.leases, old.queued, max(old.context, r.context_length), old.ready or ready
                )
    return out


def default_name(port: int) -> str:
    """A node's name when TRIOSHED_NODE_NAME is not set: this machine's name and the port."""
    return f"{socket.gethostname()}:{port}"


def to_json(node: NodeState, devices: tuple[DeviceView, ...] = ()) -> dict[str, Any]:
    """The wire form of ``node`` (what ``GET /api/fleet/state`` answers)."""
    return {
        "version": VERSION,
        "name": node.name,
        "instance": node.instance,
        "time": time.time(),
        "models": dict(node.models),
        "loaded": {
            m: {"slots": x.slots, "busy": x.busy, "queued": x.queued, "context": x.context, "ready": x.ready}
            for m, x in node.loaded.items()
        },
        "room": node.room,
        "runners": node.runners,
        "max_runners": node.max_runners,
        "queued": node.queued,
        "draining": node.draining,
        "prefixes": sorted(node.prefixes),
        "devices": [{"id": d.id, "total": d.total, "free": d.free, "used": d.used} for d in devices],
    }


def from_json(data: Any, url: str, seen: float) -> tuple[NodeState, tuple[DeviceView, ...]]:
    """A peer's state read back, received at ``seen``; ValueError when it is not one."""
    if not isinstance(data, Mapping) or data.get("version") != VERSION:
        raise ValueError(f"not a fleet state of version {VERSION}")
    try:
        loaded = {
            str(m): ModelLoad(_int(x["slots"]), _int(x["busy"]), _int(x["queued"]), _int(x["context"]), bool(x["ready"]))
            for m, x in dict(data["loaded"]).items()
        }
        node = NodeState(
            name=str(data["name"]),
            url=url,
            models={str(m): _int(b) for m, b in dict(data["models"]).items()},
            loaded=loaded,
            room=_int(data["room"]),
            runners=_int(data["runners"]),
            max_runners=_int(data["max_runners"]),
            queued=_int(data["queued"]),
            draining=bool(data["draining"]),
            prefixes=frozenset(str(p) for p in data.get("prefixes") or ()),
            seen=seen,
            instance=str(data.get("instance") or ""),
        )
        devices = tuple(
            DeviceView(str(d["id"]), _int(d["total"]), _int(d["free"]), _int(d["used"])) for d in data.get("devices") or ()
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed fleet state: {exc!r}") from None
    return node, devices


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"not a number: {value!r}")
    return int(value)
