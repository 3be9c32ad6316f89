"""TRIOSHED_RPC_SERVERS: parsing, the public-address refusal, and probing real rpc-servers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import psutil
import pytest
import trio

from trioshed.config import Settings
from trioshed.config_values import RpcServer, is_private_address, parse_rpc_servers
from trioshed.core.model import GiB, MiB
from trioshed.devices.rpc import RemoteDevices, check_addresses, parse_list_devices
from trioshed.runner.binary import BinaryNotFound, find_llama_server, find_rpc_server
from trioshed.testing.llama import free_port
from trioshed.testing.rpc import RpcServerProcess, rpc_servers, start_rpc_server


def test_parse_rpc_servers() -> None:
    servers = parse_rpc_servers("10.0.0.2:50052=24GiB, gpu-box.lan:50053,[fd00::5]:50054=512MiB")
    assert servers == (
        RpcServer("10.0.0.2", 50052, 24 * GiB),
        RpcServer("gpu-box.lan", 50053, None),
        RpcServer("fd00::5", 50054, 512 * MiB),
    )
    assert [s.address for s in servers] == ["10.0.0.2:50052", "gpu-box.lan:50053", "[fd00::5]:50054"]
    assert servers[0].device_id == "rpc:10.0.0.2:50052"


@pytest.mark.parametrize("bad", ["10.0.0.2", "10.0.0.2:x", ":50052", "10.0.0.2:70000", "h:1=lots", "h:1,h:1"])
def test_bad_rpc_servers_name_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match="TRIOSHED_RPC_SERVERS"):
        Settings.from_env({"TRIOSHED_RPC_SERVERS": bad})


def test_settings_read_the_rpc_variables() -> None:
    s = Settings.from_env(
        {"TRIOSHED_RPC_SERVERS": "127.0.0.1:50052", "TRIOSHED_RPC_ALLOW_PUBLIC": "1", "TRIOSHED_RPC_PROBE_INTERVAL": "5s"}
    )
    assert s.rpc_servers == (RpcServer("127.0.0.1", 50052),) and s.rpc_allow_public and s.rpc_probe_interval == 5


@pytest.mark.parametrize(
    ("address", "private"),
    [
        ("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.9", True), ("172.16.0.1", True),
        ("100.101.102.103", True), ("fe80::1", True), ("fd12::1", True), ("::1", True),
        ("::ffff:10.0.0.1", True), ("8.8.8.8", False), ("2001:4860::8888", False), ("::ffff:1.1.1.1", False),
    ],
)  # fmt: skip
def test_private_addresses(address: str, private: bool) -> None:
    assert is_private_address(address) is private


async def test_public_addresses_are_refused_unless_allowed() -> None:
    public = parse_rpc_servers("127.0.0.1:50052,8.8.8.8:50052")
    with pytest.raises(ValueError, match=r"8\.8\.8\.8:50052 is at a public address.*TRIOSHED_RPC_ALLOW_PUBLIC"):
        await check_addresses(public, allow_public=False)
    await check_addresses(public, allow_public=True)
    await check_addresses(parse_rpc_servers("localhost:50052,192.168.1.5:1"), allow_public=False)


def test_parse_list_devices_keeps_rpc_devices_only() -> None:
    text = (
        "ggml_cuda_init: found 1 CUDA devices\n"
        "Available devices:\n"
        "  CUDA0: NVIDIA RTX 4090 (24080 MiB, 23000 MiB free)\n"
        "  RPC0: 10.0.0.2:50052 (24105 MiB, 20000 MiB free)\n"
        "  RPC1: 10.0.0.3:50052 (8192 MiB, 8000 MiB free)\n"
    )
    listed = parse_list_devices(text)
    assert [(d.name, d.description, d.total, d.free) for d in listed] == [
        ("RPC0", "10.0.0.2:50052", 24105 * MiB, 20000 * MiB),
        ("RPC1", "10.0.0.3:50052", 8192 * MiB, 8000 * MiB),
    ]


@pytest.fixture
def one_rpc_server() -> Iterator[RpcServerProcess]:
    try:
        with rpc_servers(1) as servers:
            yield servers[0]
    except BinaryNotFound as exc:
        pytest.skip(f"no llama.cpp rpc-server binary: {exc}")


@pytest.mark.slow
async def test_probe_reads_memory_from_the_server_and_marks_a_silent_one_down(
    one_rpc_server: RpcServerProcess,
) -> None:
    binary = find_llama_server()
    closed = free_port()  # nothing listens here
    servers = parse_rpc_servers(f"{one_rpc_server.address},127.0.0.1:{closed}=4GiB,{one_rpc_server.address.replace('127.0.0.1', 'localhost')}=1GiB")
    remote = RemoteDevices(servers, llama_server=binary.path, env=binary.env, interval=3600)
    changes: list[int] = []
    remote.on_change = lambda: changes.append(1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(remote.run)
            up = {d.endpoint: d for d in remote.devices()}
            assert set(up) == {one_rpc_server.address, f"localhost:{one_rpc_server.port}"}
            reported = up[one_rpc_server.address]
            # a CPU rpc-server reports its machine's memory: about this machine's RAM
            import psutil

            assert abs(reported.total - psutil.virtual_memory().total) < 64 * MiB
            assert up[f"localhost:{one_rpc_server.port}"].total == GiB  # capped by the declared size
            (down,) = remote.down()
            assert down.endpoint == f"127.0.0.1:{closed}" and "connection refused" in down.name
            assert changes  # the scheduler is woken on every change

            # a server that dies is found by check(), and found again once it is back
            one_rpc_server.kill()
            lost = await remote.check([one_rpc_server.address])
            assert lost == [f"{one_rpc_server.address} (cannot connect: connection refused)"]
            assert one_rpc_server.address not in {d.endpoint for d in remote.devices()}
            one_rpc_server.restart()
            while one_rpc_server.address not in {d.endpoint for d in remote.devices()}:
                remote.probe_soon()
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


class FakeProbes:
    """In-process stand-ins for the TCP connect and ``--list-devices`` (no processes)."""

    def __init__(self) -> None:
        self.answering: set[str] = set()
        self.stuck: dict[str, trio.Event] = {}  # address -> released when --list-devices may answer
        self.connects: list[str] = []
        self.listings: list[str] = []
        self.cancelled: list[str] = []
        self.reported_mib = 2048  # what every server reports (2000 MiB of it free)

    async def connect(self, server: RpcServer) -> str:
        self.connects.append(server.address)
        await trio.sleep(0.001)
        return "" if server.address in self.answering else "cannot connect: connection refused"

    async def list_devices(self, server: RpcServer) -> tuple[str, int | None]:
        self.listings.append(server.address)
        try:
            if server.address in self.stuck:
                await self.stuck[server.address].wait()
            await trio.sleep(0.02)
        except trio.Cancelled:
            self.cancelled.append(server.address)
            raise
        size = self.reported_mib
        return f"Available devices:\n  RPC0: {server.address} ({size} MiB, {size - 48} MiB free)\n", 0


async def test_probes_over_time_down_retry_busy_skipped_slow_listing_never_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trioshed.devices.rpc import DOWN_RETRY, LIST_TIMEOUT

    a, b = "10.0.0.2:50052", "10.0.0.3:50052"
    fake = FakeProbes()
    fake.answering = {a}
    busy: set[str] = set()
    remote = RemoteDevices(
        parse_rpc_servers(f"{a},{b}=1GiB"), llama_server="unused", interval=60,
        connect=fake.connect, list_devices=fake.list_devices,
    )  # fmt: skip
    changes: list[float] = []
    remote.on_change = lambda: changes.append(trio.current_time())
    async with trio.open_nursery() as nursery:
        await nursery.start(remote.run, lambda: busy)
        # at start-up: A's memory as it reports it, B down
        (dev,) = remote.devices()
        assert (dev.endpoint, dev.total, dev.free) == (a, 2048 * MiB, 2000 * MiB)
        assert [d.endpoint for d in remote.down()] == [b]

        # B starts answering: found within DOWN_RETRY seconds, capped at its declared 1 GiB
        fake.answering.add(b)
        started = trio.current_time()
        await trio.sleep(DOWN_RETRY + 1)
        up = {d.endpoint: d for d in remote.devices()}
        assert set(up) == {a, b} and up[b].total == GiB
        assert started < changes[-1] <= started + DOWN_RETRY + 0.5

        # a server our runner holds is never probed; the idle one is, every interval
        busy.add(a)
        fake.connects.clear()
        await trio.sleep(60 * 2 + 1)
        assert fake.connects.count(a) == 0 and fake.connects.count(b) == 2

        # a listing that hangs (the server busy with someone else): down after LIST_TIMEOUT,
        # the probe is left to finish (never cancelled: see the module doc), then up again
        busy.clear()
        fake.stuck[a] = trio.Event()
        await trio.sleep(60 + LIST_TIMEOUT + 1)
        assert a in {d.endpoint for d in remote.down()}
        assert "did not answer" in next(d.name for d in remote.down() if d.endpoint == a)
        fake.stuck[a].set()
        await trio.sleep(1)
        assert a in {d.endpoint for d in remote.devices()} and fake.cancelled == []
        nursery.cancel_scope.cancel()


async def test_a_hung_listing_delays_no_other_server_s_check(autojump_clock: trio.testing.MockClock) -> None:
    """One server's listing that hangs does not hold back the re-check of another that is down."""
    from trioshed.devices.rpc import DOWN_RETRY

    a, b = "10.0.0.2:50052", "10.0.0.3:50052"
    fake = FakeProbes()
    fake.answering = {a}
    remote = RemoteDevices(
        parse_rpc_servers(f"{a},{b}"), llama_server="unused", interval=60,
        connect=fake.connect, list_devices=fake.list_devices,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(remote.run, frozenset)
        assert [d.endpoint for d in remote.down()] == [b]
        fake.stuck[a] = trio.Event()  # A's next listing (the 60 s re-probe) hangs
        await trio.sleep(60.5)
        assert fake.listings.count(a) == 2
        fake.answering.add(b)  # B is restarted
        await trio.sleep(DOWN_RETRY + 0.5)
        assert b in {d.endpoint for d in remote.devices()}
        nursery.cancel_scope.cancel()


def one_answering_server(address: str, *, interval: float) -> tuple[FakeProbes, RemoteDevices]:
    """One RPC server at ``address`` that answers, probed through :class:`FakeProbes`."""
    fake = FakeProbes()
    fake.answering = {address}
    remote = RemoteDevices(
        parse_rpc_servers(address), llama_server="unused", interval=interval, connect=fake.connect, list_devices=fake.list_devices
    )
    return fake, remote


async def test_a_hung_listing_never_stops_the_checks_of_its_server(autojump_clock: trio.testing.MockClock) -> None:
    """A listing that hangs: the server is down after LIST_TIMEOUT and checked again every
    DOWN_RETRY; at most two listings wait on it; a server seen refusing connections is gone, and
    the listings that waited on it end (killed); once it answers again it is up again."""
    from trioshed.devices.rpc import DOWN_RETRY, LIST_TIMEOUT

    a = "10.0.0.2:50052"
    fake, remote = one_answering_server(a, interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(remote.run, frozenset)
        fake.stuck[a] = trio.Event()  # the server is stopped: it accepts, never answers
        await trio.sleep(3600 + LIST_TIMEOUT + 1)
        assert "did not answer" in remote.down()[0].name
        await trio.sleep(5 * DOWN_RETRY)
        assert fake.listings.count(a) == 3  # the first, the hung one and one more beside it
        fake.answering.clear()  # the stopped server is killed
        await trio.sleep(DOWN_RETRY + 1)
        assert "connection refused" in remote.down()[0].name
        assert fake.cancelled == [a, a]  # nothing will ever answer them
        del fake.stuck[a]
        fake.answering.add(a)  # and started again
        await trio.sleep(DOWN_RETRY + 1)
        assert [d.endpoint for d in remote.devices()] == [a]
        nursery.cancel_scope.cancel()


async def test_a_listing_left_waiting_on_a_server_gone_does_not_keep_its_successor_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A listing that waits on a connection to a server that went away unseen (no refusal: a
    half-open connection; the new server took the port meanwhile): the new server is listed
    beside it and is up; the old listing is left to end (it is not the new server's client)."""
    from trioshed.devices.rpc import DOWN_RETRY, LIST_TIMEOUT

    a = "10.0.0.2:50052"
    fake, remote = one_answering_server(a, interval=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(remote.run, frozenset)
        old = fake.stuck[a] = trio.Event()
        await trio.sleep(60.5)  # the re-probe's listing waits on the old server
        del fake.stuck[a]  # the new server answers
        await trio.sleep(LIST_TIMEOUT + DOWN_RETRY + 1)
        assert [d.endpoint for d in remote.devices()] == [a]
        assert fake.listings.count(a) == 3 and fake.cancelled == []
        old.set()
        await trio.sleep(1)
        assert [d.endpoint for d in remote.devices()] == [a]
        nursery.cancel_scope.cancel()


def _our_listings() -> list[psutil.Process]:
    """The ``--list-devices`` probes this test process started that still run."""
    return [
        p for p in psutil.Process().children(recursive=True)
        if "--list-devices" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE
    ]  # fmt: skip


@pytest.mark.slow
async def test_a_server_restarted_on_its_port_is_found_while_a_probe_still_waits_on_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The port's old server accepted a probe's connection and went away unseen (the connection
    left open, as on a host that lost power); a real rpc-server took the port: it is listed
    beside the old probe and is up; the old probe ends with the probes (killed, reaped)."""
    from trioshed.devices import rpc

    monkeypatch.setattr(rpc, "LIST_TIMEOUT", 1.0)
    monkeypatch.setattr(rpc, "DOWN_RETRY", 0.2)
    try:
        binary = find_llama_server()
        find_rpc_server()
    except BinaryNotFound as exc:
        pytest.skip(f"no llama.cpp binaries: {exc}")
    port = free_port()
    address = f"127.0.0.1:{port}"
    old = socket.socket()  # the old server: takes connections, never answers
    old.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    old.bind(("127.0.0.1", port))
    old.listen()
    old.settimeout(10)
    held: list[socket.socket] = []
    remote = RemoteDevices(parse_rpc_servers(address), llama_server=binary.path, env=binary.env, interval=3600)
    new: RpcServerProcess | None = None
    up = trio.Event()

    def on_change() -> None:
        if remote.devices():
            up.set()

    remote.on_change = on_change
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(remote.run)
                (down,) = remote.down()
                assert "did not answer" in down.name
                (waiting,) = _our_listings()
                while len(held) < 2:  # the connect check's connection and the probe's
                    held.append(old.accept()[0])
                # at once, no probe in between: the old server's listener goes, a new one takes the port
                old.close()
                new = start_rpc_server(port)
                await up.wait()
                assert _our_listings() == [waiting]  # left to end: it is no client of the new server
                nursery.cancel_scope.cancel()
        assert not _our_listings() and not waiting.is_running()
    finally:
        old.close()
        for conn in held:
            conn.close()
        if new is not None:
            new.kill()


async def test_one_server_under_two_names_is_refused() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:50052 and localhost:50052 are the same server"):
        await check_addresses(parse_rpc_servers("127.0.0.1:50052,localhost:50052"), allow_public=True)
