"""The status page's picture of the server: plain data built from the scheduler's snapshot.

No I/O here: :func:`status` takes ``statistics()`` and the devices as polled, and returns the
JSON-ready dict that ``GET /api/events`` sends as its ``state`` message (and the page draws).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from trioshed.core.model import Device, MiB
from trioshed.core.sched import CPU_ID
from trioshed.scheduler.stats import SchedulerStatistics


def status(
    stats: SchedulerStatistics,
    gpus: tuple[Device, ...],
    system: Device,
    *,
    free_known: bool,
    overhead: int,
    now: float,
) -> dict[str, Any]:
    """``free_known``: whether the GPUs report their free memory (NVML) or are only accounted
    (a declared inventory); system memory always reports it. ``overhead``: bytes reserved per
    GPU (TRIOSHED_GPU_OVERHEAD). ``now``: wall-clock seconds."""
    held: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in stats.runners:
        cache = _prompt_cache(r)
        for device_id, nbytes in r.usage:
            if device_id == CPU_ID and cache:  # the prompt-cache reservation, named apart
                own = max(0, nbytes - cache)
                if own:
                    held[device_id].append({"model": r.model, "bytes": own})
                held[device_id].append({"model": r.model, "bytes": min(cache, nbytes), "prompt_cache": True})
            elif nbytes > 0:
                held[device_id].append({"model": r.model, "bytes": nbytes})
    devices = []
    for gpu in gpus:
        devices.append(_device(gpu, "gpu", gpu.free if free_known else None, overhead, held.pop(gpu.id, [])))
    devices.append(_device(system, "system", system.free, 0, held.pop(system.id, [])))
    for server in stats.remote:
        device_id = f"rpc:{server.address}"
        entry = _device(Device(device_id, "rpc", 0, server.total, server.free, name=f"RPC server {server.address}"),
                        "rpc", server.free if server.up else None, 0, held.pop(device_id, []))  # fmt: skip
        entry["up"] = server.up
        entry["reason"] = server.reason
        devices.append(entry)
    for device_id, runners in held.items():  # accounted on a device no longer listed
        devices.append(_device(Device(device_id, "gone", 0, sum(r["bytes"] for r in runners), 0, name=device_id), "gone", None, 0, runners))
    return {
        "time": now,
        "devices": devices,
        "runners": [_runner(r) for r in stats.runners],
        "queue": [
            {"model": q.model, "key": q.key, "waiting": q.waiting, "since": q.since}
            for q in stats.queue
        ],
        "totals": {
            name: getattr(stats, name)
            for name in ("queued", "leased", "loads", "unloads", "crashes", "load_failures", "rejected")
        },
    }


def _device(device: Device, kind: str, free: int | None, reserved: int, runners: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": device.id,
        "name": device.name or device.id,
        "kind": kind,
        "total": device.total,
        "free": free,
        "reserved": reserved,
        "up": True,
        "reason": "",
        "runners": runners,
    }


def _prompt_cache(r: Any) -> int:
    """The bytes of llama-server's host prompt cache (``--cache-ram``) the runner reserves."""
    return max(0, r.options.cache_ram_mib) * MiB


def _runner(r: Any) -> dict[str, Any]:
    measured = r.measured.total if r.measured is not None and r.measured.total > 0 else None
    return {
        "id": r.id,
        "model": r.model,
        "state": r.state,
        "evicting": r.evicting,
        "slots": r.slots,
        "leases": r.leases,
        "waiting": r.waiting,
        "keep_alive": None if r.keep_alive == math.inf else r.keep_alive,
        "expires_at": None if r.expires_at == math.inf else r.expires_at,
        "size": r.size,
        "estimated": r.estimate.total,
        "measured": measured,
        "prompt_cache": _prompt_cache(r),
        "pinned": r.pinned,
        "devices": list(r.placement.devices),
    }
