"""Many nodes as one service: any node takes any request and serves it where it is best served.

Rooms: :mod:`~trioshed.fleet.auth` (signed node-to-node requests, the key name a forwarded
request carries),
:mod:`~trioshed.fleet.state` (a node's published state), :mod:`~trioshed.fleet.peers` (where
the other nodes' states come from: a static list), :mod:`~trioshed.fleet.dbpeers` (or the
shared database), :mod:`~trioshed.fleet.relay` (a request sent on, its answer
back), :mod:`~trioshed.fleet.node` (this node's part: route, relay, poll). The decision itself
is :func:`trioshed.core.route.choose`, pure. :func:`build_fleet` puts them together for ``serve()``.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from trioshed.config import Settings
from trioshed.devices import DeviceSource
from trioshed.fleet.auth import FleetAuth
from trioshed.fleet.dbpeers import DatabasePeers, state_of
from trioshed.fleet.node import Fleet
from trioshed.fleet.peers import StateSource, StaticPeers
from trioshed.fleet.state import LocalNode
from trioshed.models.stores import Stores
from trioshed.scheduler.stats import SchedulerStatistics


def build_fleet(
    settings: Settings,
    name: str,
    stats: Callable[[], SchedulerStatistics],
    store: Stores,
    devices: DeviceSource,
    estimate: Callable[[Any], int],
) -> Fleet | None:
    """This node's fleet (None without ``TRIOSHED_FLEET_SECRET``): its peers from ``TRIOSHED_PEERS``,
    else from ``TRIOSHED_DATABASE``. Its HTTP client is closed by :meth:`Fleet.run`'s end;
    ValueError when the database is the way and this node cannot say where it is reached."""
    if not settings.fleet_discovery:
        return None
    assert settings.fleet_secret is not None
    if problem := settings.fleet_url_problem():
        raise ValueError(problem)
    auth = FleetAuth(settings.fleet_secret, name, window=settings.fleet_window)
    tls = fleet_tls(settings)
    local = LocalNode(
        name, stats, store, devices, estimate,
        max_loaded_models=settings.max_loaded_models, gpu_overhead=settings.gpu_overhead,
    )  # fmt: skip
    import httpx  # imported only by a node in a fleet (a server alone never pays its memory)

    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=3.0, read=settings.stream_idle_timeout, write=60.0, pool=10.0),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        trust_env=False,  # node-to-node: no proxy from the environment
        verify=tls,
    )
    source: StateSource
    if settings.fleet_discovery == "database":
        assert settings.database is not None
        from trioshed.usage.pg import PgStore  # psycopg: only with a team database

        table = PgStore(settings.database, max_size=1)  # its own connection: one exchange at a time
        source = DatabasePeers(
            table, name, state_of(local), interval=settings.fleet_interval, stale_after=settings.fleet_stale, url=settings.fleet_url
        )  # fmt: skip
    else:
        source = StaticPeers(settings.peers, auth, name, client, interval=settings.fleet_interval, self_instance=local.instance)
    return Fleet(local, source, auth, client, interval=settings.fleet_interval, stale_after=settings.fleet_stale, ssl_context=tls)


def fleet_tls(settings: Settings) -> ssl.SSLContext:
    """How nodes reached over ``https://`` are verified: against ``TRIOSHED_FLEET_CA`` (a PEM
    file of the certificates to trust) where set, else the system's CAs. ValueError when the file
    cannot be read as certificates."""
    if settings.fleet_ca is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=str(settings.fleet_ca))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TRIOSHED_FLEET_CA={settings.fleet_ca}: not a readable PEM file of certificates ({exc})") from None
