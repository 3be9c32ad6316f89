"""The scheduler with RPC servers, under MockClock: fake runners, fake probes, real placement.

"big" (4 layers + output, 1.6 GiB each) needs the declared local GPU (one layer) and both RPC
servers (two each); system memory is too small for the rest.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.devices.test_rpc_devices import FakeProbes
from trioshed.config_values import parse_rpc_servers
from trioshed.core.model import Device, GiB, ModelSpec, RunnerOptions
from trioshed.core.placement import place
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import DOWN_RETRY, RemoteDevices
from trioshed.errors import RemoteUnavailable
from trioshed.scheduler import Scheduler
from trioshed.testing.fake import FakeFactory, fixed_estimator

A, B = "10.0.0.2:50052", "10.0.0.3:50052"


def spec(name: str) -> ModelSpec:
    return ModelSpec(name=f"{name}:latest", path=f"/models/{name}.gguf")


def scheduler(fake: FakeProbes, factory: FakeFactory) -> Scheduler:
    devices = DeviceSource(
        (Device("cuda:0", "cuda", 0, 2 * GiB, 2 * GiB),),
        "declared",
        accounting_only=True,
        fixed_system=Device("cpu", "cpu", 0, GiB, GiB),
    )
    remote = RemoteDevices(
        parse_rpc_servers(f"{A}=4GiB,{B}=4GiB"), llama_server="unused", interval=600,
        connect=fake.connect, list_devices=fake.list_devices,
    )  # fmt: skip
    return Scheduler(
        devices=devices,
        factory=factory,
        estimator=fixed_estimator({"big": 8 * GiB, "other": 3 * GiB}),
        place=place,
        remote=remote,
    )


async def test_rpc_runner_lifecycle(autojump_clock: trio.testing.MockClock) -> None:
    fake = FakeProbes()
    fake.reported_mib = 8192  # capped at the declared 4 GiB
    fake.answering = {A, B}
    factory = FakeFactory(load_time=1.0)
    sched = scheduler(fake, factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        assert [(s.address, s.up, s.total) for s in sched.statistics().remote] == [(A, True, 4 * GiB), (B, True, 4 * GiB)]

        lease = await sched.wait_for_lease(spec("big"), RunnerOptions(), None)
        placement = factory.runner("big").placement
        assert placement.endpoints == (A, B) and placement.layers == (1, 2, 2)
        assert {s.address: s.model for s in sched.statistics().remote} == {A: "big:latest", B: "big:latest"}

        # "other" would fit on either server's free room, but both have their one client
        fake.connects.clear()

        async def other() -> None:
            async with sched.acquire(spec("other"), RunnerOptions(), None):
                pass

        nursery.start_soon(other)
        await trio.sleep(30)
        assert factory.started == 1 and sched.statistics().queued == 1
        assert fake.connects == []  # servers held by a runner are never probed

        # B dies under the leased runner: the crash names it, B is down
        fake.answering.discard(B)
        factory.runner("big").crash(-6)
        await sched.wait_statistics(lambda s: s.crashes == 1)
        assert lease.crash is not None
        assert f"its RPC server {B} (cannot connect: connection refused) stopped answering" in lease.crash.message
        lease.release()
        assert {s.address: s.up for s in sched.statistics().remote} == {A: True, B: False}
        await trio.sleep(5)  # "other" got its runner meanwhile (on a free server)
        assert factory.started == 2

        # "big" fits only with B: 503 naming it
        with pytest.raises(RemoteUnavailable, match=B):
            await sched.wait_for_lease(spec("big"), RunnerOptions(), None)

        # B is back: found within DOWN_RETRY, and "big" loads on both servers again
        fake.answering.add(B)
        await trio.sleep(DOWN_RETRY + 1)
        assert all(s.up for s in sched.statistics().remote)
        async with sched.acquire(spec("big"), RunnerOptions(), None):
            assert factory.runner("big").placement.endpoints == (A, B)
        nursery.cancel_scope.cancel()
