"""Remote devices: llama.cpp RPC servers (``TRIOSHED_RPC_SERVERS``), their memory and liveness.

Each server is one remote :class:`~trioshed.core.model.Device` (id ``"rpc:<host>:<port>"``) while
it answers; one that does not is *down*, left out of placement until it answers again.

How a server is probed, and why so (measured with the bundled build, RPC protocol 4.0.3):

* **Liveness: a TCP connect, closed at once without a byte sent.** The server serves one client
  at a time and queues the next in its listen backlog. A client that sends a request and goes
  away before the answer makes the server die of SIGPIPE when it gets to it (seen: exit 141 after
  a killed ``--list-devices``). A connect-and-close costs the server one empty read, whatever it
  is doing; a refused or timed-out connect is "down".
* **Memory: ``llama-server --rpc <host:port> --list-devices``** with the runner binary itself
  (about 20 ms). It speaks whatever protocol version that llama-server speaks (a mismatch shows as
  no RPC device and the server counts as down, instead of a runner that fails to load), and it
  prints the devices under the names and sizes llama-server will use
  (``RPC0: 10.0.0.2:50052 (24105 MiB, 24105 MiB free)``). It runs only while no runner of ours
  uses the server (it would wait behind that client), and it is never killed on a time-out, for
  the SIGPIPE reason above: a probe that is slow marks the server down and is left to finish.
  The server is still checked meanwhile, on its own (a slow probe holds back no other server's):
  at most MAX_LISTINGS probes wait on it at once (one more may find a restarted server while an
  older one waits on a connection to the one gone), and once it refuses connections nothing
  listens there to answer them: they are killed then (and when trioshed stops).
  A CPU rpc-server reports its machine's whole RAM as free; a declared size
  (``host:port=16GiB``) caps what trioshed places there.

Servers used by a runner are not probed: the runner's own fate says whether they live (llama.cpp
aborts when a server it computes on goes away; the scheduler then calls :meth:`RemoteDevices.check`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import subprocess
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace

import trio

from trioshed.config_values import RpcServer, is_private_address
from trioshed.core.model import RPC_LIBRARY, Device, MiB

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 2.0
LIST_TIMEOUT = 10.0
DOWN_RETRY = 5.0  # seconds between checks of a server that is down
MAX_LISTINGS = 2  # --list-devices probes waiting on one server at once
_REFUSED = os.strerror(errno.ECONNREFUSED).lower()

_DEVICE_LINE = re.compile(r"^\s*(RPC\d+):\s*(.*?)\s*\((\d+) MiB, (\d+) MiB free\)\s*$")


@dataclass(frozen=True)
class ListedDevice:
    """One line of ``llama-server --list-devices``."""

    name: str
    description: str
    total: int
    free: int


def parse_list_devices(text: str) -> list[ListedDevice]:
    """The RPC devices in ``--list-devices`` output (local devices such as CUDA0 are skipped)."""
    out = []
    for line in text.splitlines():
        m = _DEVICE_LINE.match(line)
        if m:
            out.append(ListedDevice(m.group(1), m.group(2), int(m.group(3)) * MiB, int(m.group(4)) * MiB))
    return out


@dataclass(frozen=True)
class RemoteStats:
    """One RPC server as ``/api/ps`` and ``/metrics`` show it (``used``: the scheduler's part)."""

    address: str
    up: bool
    reason: str  # why it is down; "" while up
    total: int
    free: int
    source: str  # "reported" (by the server), "declared" (TRIOSHED_RPC_SERVERS) or "reported, capped"
    model: str = ""  # the runner using it, if any
    used: int = 0


@dataclass
class _Endpoint:
    server: RpcServer
    index: int
    up: bool = False
    reason: str = "not checked yet"
    total: int = 0
    free: int = 0
    source: str = ""
    probing: bool = False  # a probe (connect, then maybe a listing) is under way
    listings: list[trio.CancelScope] = field(default_factory=list)  # --list-devices outstanding

    def device(self) -> Device:
        return Device(
            self.server.device_id, RPC_LIBRARY, self.index, self.total, self.free, name=self.server.address
        )


class RemoteDevices:
    """The RPC servers and what is known of them; ``run()`` keeps that up to date.

    ``busy()`` (given to ``run``) names the servers our runners use now: they are not probed.
    ``on_change()`` is called whenever a server goes up or down or its size changes.
    """

    def __init__(
        self,
        servers: tuple[RpcServer, ...],
        *,
        llama_server: str,
        env: dict[str, str] | None = None,
        interval: float = 30.0,
        connect: Callable[[RpcServer], Awaitable[str]] | None = None,
        list_devices: Callable[[RpcServer], Awaitable[tuple[str, int | None]]] | None = None,
    ) -> None:
        self._endpoints = {s.address: _Endpoint(s, i) for i, s in enumerate(servers)}
        # The two probes (tests give fakes): a TCP connect, and llama-server --list-devices.
        self._connect = connect or tcp_check
        self._list_devices = list_devices or functools.partial(run_list_devices, llama_server, env)
        self.interval = interval
        self.on_change: Callable[[], None] = lambda: None
        self._busy: Callable[[], Collection[str]] = frozenset
        self._nursery: trio.Nursery | None = None
        self._kick = trio.Event()

    # -- what the scheduler reads (synchronous snapshots) -------------------------------------

    def devices(self) -> tuple[Device, ...]:
        """The servers that answer, as devices (``free`` as last reported while idle)."""
        return tuple(e.device() for e in self._endpoints.values() if e.up)

    def down(self) -> tuple[Device, ...]:
        """The servers that do not answer; ``name`` says which and why."""
        return tuple(
            replace(e.device(), name=f"{e.server.address} ({e.reason})")
            for e in self._endpoints.values()
            if not e.up
        )

    def statistics(self, usage: dict[str, tuple[str, int]] | None = None) -> tuple[RemoteStats, ...]:
        """Per server: state, size, and (from ``usage``: address → (model, bytes)) its user."""
        usage = usage or {}
        return tuple(
            RemoteStats(
                address=addr,
                up=e.up,
                reason="" if e.up else e.reason,
                total=e.total,
                free=e.free,
                source=e.source,
                model=usage.get(addr, ("", 0))[0],
                used=usage.get(addr, ("", 0))[1],
            )
            for addr, e in self._endpoints.items()
        )

    # -- probing -------------------------------------------------------------------------------

    async def run(
        self,
        busy: Callable[[], Collection[str]] = frozenset,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Probe every server, report started, then re-probe: idle ones every ``interval``,
        down ones every DOWN_RETRY seconds (sooner after :meth:`check` found one down)."""
        self._busy = busy
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._probe_all(wait=True)
            task_status.started()
            next_full = trio.current_time() + self.interval
            while True:  # (every DOWN_RETRY: a probe under way may find its server down meanwhile)
                with trio.move_on_at(min(next_full, trio.current_time() + DOWN_RETRY)):
                    await self._kick.wait()
                self._kick = trio.Event()
                if trio.current_time() >= next_full:
                    next_full = trio.current_time() + self.interval
                    await self._probe_all()
                else:
                    await self._probe_all(only_down=True)

    async def _probe_all(self, *, only_down: bool = False, wait: bool = False) -> None:
        """Start a probe of each server due (each on its own: a slow one holds back no other)."""
        assert self._nursery is not None
        busy = set(self._busy())
        started = []
        for addr, e in self._endpoints.items():
            if addr in busy or e.probing or (only_down and e.up):
                continue
            e.probing = True
            started.append(trio.Event())
            self._nursery.start_soon(self._probe, e, started[-1])
        if wait:
            for finished in started:
                await finished.wait()

    async def _probe(self, e: _Endpoint, finished: trio.Event) -> None:
        try:
            why = await self._connect(e.server)
            if why:
                self._down(e, why)
                return
            if e.server.address in set(self._busy()):
                return  # a runner took it meanwhile: it answers, and must not be queued behind
            if len(e.listings) >= MAX_LISTINGS:
                return  # one more would only wait behind them
            assert self._nursery is not None
            done = trio.Event()
            self._nursery.start_soon(self._list, e, done)
            with trio.move_on_after(LIST_TIMEOUT):
                await done.wait()
                return
            if e.server.address not in set(self._busy()):
                self._set(e, up=False, reason=f"accepts connections but did not answer in {LIST_TIMEOUT:.0f}s "
                          "(serving another client?)")  # fmt: skip
        finally:
            e.probing = False
            finished.set()

    async def _list(self, e: _Endpoint, done: trio.Event) -> None:
        """Run ``--list-devices`` to its end: never killed early, unless its server is gone
        (:meth:`_down`; see the module doc)."""
        scope = trio.CancelScope()
        e.listings.append(scope)
        try:
            with scope:
                text, returncode = await self._list_devices(e.server)
                self._apply_listing(e, text, returncode)
        finally:
            e.listings.remove(scope)
            done.set()

    def _down(self, e: _Endpoint, why: str) -> None:
        """It does not take connections; refused, nothing listens there: the listings still
        waiting on it wait on a server that is gone, and are killed."""
        self._set(e, up=False, reason=why)
        if _REFUSED in why:
            for scope in e.listings:
                scope.cancel()

    def _apply_listing(self, e: _Endpoint, text: str, returncode: int | None) -> None:
        listed = parse_list_devices(text)
        declared = e.server.declared
        if listed:
            if len(listed) > 1:
                log.warning("RPC server %s has %d devices; trioshed uses the first (run one rpc-server "
                            "per device)", e.server.address, len(listed))  # fmt: skip
            first = listed[0]
            total = min(first.total, declared) if declared else first.total
            source = "reported, capped" if declared and declared < first.total else "reported"
            self._set(e, up=True, reason="", total=total, free=min(first.free, total), source=source)
        elif declared and returncode is None:
            self._set(e, up=True, reason="", total=declared, free=declared, source="declared")
        else:
            last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
            self._set(e, up=False, reason=f"llama-server lists no device for it ({last[-200:]!r})")

    def _set(self, e: _Endpoint, **changes: object) -> None:
        before = (e.up, e.reason, e.total, e.free)
        for key, value in changes.items():
            setattr(e, key, value)
        if (e.up, e.reason, e.total, e.free) != before:
            if e.up != before[0]:
                log.log(logging.INFO if e.up else logging.WARNING, "RPC server %s is %s", e.server.address,
                        "up" if e.up else f"down: {e.reason}")  # fmt: skip
            self.on_change()

    async def check(self, addresses: Collection[str]) -> list[str]:
        """After a runner that used ``addresses`` failed: which of them answer no more?

        A TCP connect to each (they are free of that runner now); those refused or silent are
        marked down at once and rechecked every DOWN_RETRY seconds. Returns "address (why)" for
        each one down.
        """
        lost: list[str] = []

        async def one(e: _Endpoint) -> None:
            why = await self._connect(e.server)
            if why:
                self._down(e, why)
                lost.append(f"{e.server.address} ({why})")

        async with trio.open_nursery() as nursery:
            for addr in addresses:
                if addr in self._endpoints:
                    nursery.start_soon(one, self._endpoints[addr])
        self._kick.set()
        return sorted(lost)

    def probe_soon(self) -> None:
        """Re-check the servers that are down now (tests, and after a server was restarted)."""
        self._kick.set()


async def tcp_check(server: RpcServer) -> str:
    """'' when a TCP connection opens (closed at once, nothing sent); else why not."""
    with trio.move_on_after(CONNECT_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(server.host, server.port)
        except OSError as exc:
            return f"cannot connect: {_os_reason(exc)}"
        await stream.aclose()
        return ""
    return f"no answer to a connection within {CONNECT_TIMEOUT:.0f}s"


#: A probe lists remote devices only: local GPUs are hidden from it, so that it neither pays a
#: driver initialisation nor takes GPU memory (which would disturb NVML's free readings).
HIDE_LOCAL_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


async def run_list_devices(binary: str, env: dict[str, str] | None, server: RpcServer) -> tuple[str, int | None]:
    """``llama-server --rpc <server> --list-devices``: (its output, exit code; None: cannot run)."""
    try:
        result = await trio.run_process(
            [binary, "--rpc", server.address, "--list-devices"],
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
            env={**(env if env is not None else os.environ), **HIDE_LOCAL_GPUS},
            deliver_cancel=_kill,  # cancelled (its server gone, trioshed stopping): killed and reaped
        )
    except OSError as exc:
        return f"cannot run {binary}: {exc}", None
    return result.stdout.decode("utf-8", "replace"), result.returncode


async def _kill(process: trio.Process) -> None:
    process.kill()


def _os_reason(exc: OSError) -> str:
    """"Connection refused" rather than trio's "all attempts to connect to ... failed"."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        for inner in cause.exceptions:
            if isinstance(inner, OSError) and inner.errno:
                return os.strerror(inner.errno).lower()
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


async def check_addresses(servers: tuple[RpcServer, ...], *, allow_public: bool) -> None:
    """Refuse RPC servers at public addresses (RPC is unauthenticated) unless ``allow_public``,
    and one server listed under two names.

    Host names are resolved once here; a name that does not resolve is left to the probes.
    """
    seen: dict[tuple[str, int], str] = {}
    for server in servers:
        try:
            infos = await trio.socket.getaddrinfo(server.host, server.port, type=trio.socket.SOCK_STREAM)
        except OSError:
            continue
        addresses = {str(info[4][0]) for info in infos}
        for ip in sorted(addresses):
            other = seen.setdefault((ip, server.port), server.address)
            if other != server.address:  # one server under two names: two runners could share it
                raise ValueError(
                    f"TRIOSHED_RPC_SERVERS: {other} and {server.address} are the same server "
                    f"({ip}:{server.port}); list each RPC server once"
                )
        public = sorted(ip for ip in addresses if not is_private_address(ip))
        if public and not allow_public:
            raise ValueError(
                f"TRIOSHED_RPC_SERVERS: {server.address} is at a public address ({', '.join(public)}); "
                "llama.cpp's RPC protocol has no authentication or encryption: use it on a trusted "
                "LAN only, or set TRIOSHED_RPC_ALLOW_PUBLIC=1 if this network is trusted anyway"
            )
