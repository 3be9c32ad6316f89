"""Prometheus metrics at /metrics, read from the scheduler's statistics() snapshot."""

from __future__ import annotations

from quart import Blueprint, Response, current_app

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
async def metrics() -> Response:
    stats = current_app.config["TRIOSHED"].scheduler.statistics()
    lines = [
        "# HELP trioshed_queued_requests Requests waiting for a runner.",
        "# TYPE trioshed_queued_requests gauge",
        f"trioshed_queued_requests {stats.queued}",
        "# TYPE trioshed_leases gauge",
        f"trioshed_leases {stats.leased}",
        "# TYPE trioshed_runners gauge",
        f'trioshed_runners{{state="ready"}} {stats.loaded}',
        f'trioshed_runners{{state="loading"}} {stats.loading}',
        f'trioshed_runners{{state="unloading"}} {stats.unloading}',
    ]
    for name in ("loads", "unloads", "crashes", "load_failures", "rejected", "room_waits"):
        if name == "room_waits":
            lines.append("# HELP trioshed_room_waits_total Requests that had to wait for memory, each counted once.")
        lines += [f"# TYPE trioshed_{name}_total counter", f"trioshed_{name}_total {getattr(stats, name)}"]
    lines.append("# TYPE trioshed_runner_bytes gauge")
    for r in stats.runners:
        lines.append(f'trioshed_runner_bytes{{model="{r.model}",kind="total"}} {r.size}')
        lines.append(f'trioshed_runner_bytes{{model="{r.model}",kind="vram"}} {r.size_vram}')
        lines.append(f'trioshed_runner_leases{{model="{r.model}"}} {r.leases}')
    if stats.remote:  # TRIOSHED_RPC_SERVERS: one series per server
        lines.append("# TYPE trioshed_rpc_server_up gauge")
        lines += [f'trioshed_rpc_server_up{{endpoint="{s.address}"}} {int(s.up)}' for s in stats.remote]
        lines.append("# TYPE trioshed_rpc_server_bytes gauge")
        for s in stats.remote:
            lines.append(f'trioshed_rpc_server_bytes{{endpoint="{s.address}",kind="total"}} {s.total}')
            lines.append(f'trioshed_rpc_server_bytes{{endpoint="{s.address}",kind="used"}} {s.used}')
    return Response("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4")
