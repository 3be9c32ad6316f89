"""Adapter groups in the scheduler, with in-process fake runners and simulated time (autojump
MockClock): one runner serves a base and its adapter-models, each request selects its adapters,
the adapter sets take turns with a bound, and a group that grows loads its larger runner beside
the old one, which drains, with no request lost."""

from __future__ import annotations

import math
from dataclasses import replace

import trio
import trio.testing

from tests.scheduler import harness
from tests.scheduler.harness import GiB
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.fleet.state import loaded_of

BASE = "/models/alpha.gguf"


def member(name: str, *adapters: str, group: tuple[str, ...] = ()) -> ModelSpec:
    """A model of the ``alpha`` group: ``adapters`` its own, ``group`` every adapter of the group."""
    return ModelSpec(f"{name}:latest", BASE, adapters=adapters, group=group or GROUP)


GROUP = ("/models/l1.gguf", "/models/l2.gguf", "/models/l3.gguf", "/models/l4.gguf")
MODELS = {
    "alpha": member("alpha"),
    **{f"a{i}": member(f"a{i}", f"/models/l{i}.gguf") for i in range(1, 5)},
}


def running(*, system: float = 64, max_loaded: int = 0, load_time: float = 1.0):  # type: ignore[no-untyped-def]
    """The group's models, each 1 GiB, on ``system`` GiB of RAM and no GPU."""
    sizes = {name: 1.0 for name in (*MODELS, "a5")}
    return harness.running(sizes, gpus=(), system=system, max_loaded=max_loaded, load_time=load_time,
                           max_queue=512)  # fmt: skip


async def test_a_base_and_four_adapter_models_rotating_are_one_load(autojump_clock: trio.testing.MockClock) -> None:
    async with running() as h:
        names = ["alpha", "a1", "a2", "a3", "a4"]
        for i in range(25):
            spec = MODELS[names[i % 5]]
            async with h.sched.acquire(spec, RunnerOptions()) as lease:
                assert lease.model.adapters == GROUP  # the runner holds the whole group
                wanted = {GROUP.index(a): 1.0 for a in spec.adapters}
                assert lease.lora == [{"id": k, "scale": wanted.get(k, 0.0)} for k in range(4)]
        stats = h.sched.statistics()
        assert (stats.loads, h.factory.started) == (1, 1)
        assert [m.name for m in stats.runners[0].members] == ["a4:latest", "a3:latest", "a2:latest", "a1:latest", "alpha:latest"]


async def test_the_fleet_sees_every_warm_member_of_a_group(autojump_clock: trio.testing.MockClock) -> None:
    """What this node publishes to the others: each warm member of a group's one runner is
    loaded here (its slots shared), so a request for any of them entering elsewhere comes here."""
    async with running() as h:
        for name in ("a1", "a3", "alpha"):
            async with h.sched.acquire(MODELS[name], RunnerOptions()):
                pass
        release = trio.Event()
        await h.hold(MODELS["a1"], release)
        loaded = loaded_of(h.sched.statistics())
        assert set(loaded) == {"a1:latest", "a3:latest", "alpha:latest"}
        assert all((m.slots, m.busy, m.ready) == (1, 1, True) for m in loaded.values())
        release.set()


async def test_an_embedding_request_gets_a_runner_with_only_its_adapters(autojump_clock: trio.testing.MockClock) -> None:
    async with running() as h:
        async with h.sched.acquire(MODELS["a1"], RunnerOptions()) as lease:
            assert lease.model.adapters == GROUP
        async with h.sched.acquire(MODELS["a2"], RunnerOptions(embedding=True, cache_ram_mib=0)) as lease:
            assert lease.model.adapters == ("/models/l2.gguf",) and not lease.model.group  # fixed: cannot select
            assert lease.lora == [{"id": 0, "scale": 1.0}]
        assert h.factory.started == 2


async def test_adapter_sets_take_turns_with_a_bound(autojump_clock: trio.testing.MockClock) -> None:
    """One slot; a1's clients queue ten requests, then one request each for a2 and the base:
    each other set is served within one turn (one slot) of a1, not after all of a1's."""
    async with running() as h:
        release = trio.Event()
        await h.hold(MODELS["a1"], release)
        got: list[str] = []
        for _ in range(10):
            h.want(MODELS["a1"], got)
        await trio.testing.wait_all_tasks_blocked()
        h.want(MODELS["a2"], got)
        await trio.testing.wait_all_tasks_blocked()
        h.want(MODELS["alpha"], got)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        while len(got) < 12:
            await h.sched.wait_changed()
        # a1 had the turn: the next slot goes to the set served longest ago (a2, never), then
        # the base, then a1 again: neither waits for a1's ten. (The order of the grants, as the
        # scheduler made them: the tasks that got them run in Trio's order.)
        granted = [name for _, name in h.events("dispatch")][1:]
        assert granted[:3] == ["a2", "alpha", "a1"] and granted.count("a1") == 10


async def test_turns_fill_a_runner_with_one_set_at_a_time(autojump_clock: trio.testing.MockClock) -> None:
    """Two slots: a turn gives both to one set (they batch in one decode step), then passes."""
    async with running() as h:
        options = RunnerOptions(num_parallel=2)
        first, second = trio.Event(), trio.Event()
        await h.hold(MODELS["a1"], first, options=options)
        await h.hold(MODELS["a1"], second, options=options)
        got: list[str] = []
        for name in ["a2", "a3", "a2", "a3", "a2", "a3"]:
            h.want(MODELS[name], got, options=options)
            await trio.testing.wait_all_tasks_blocked()
        first.set()
        second.set()
        while len(got) < 6:
            await h.sched.wait_changed()
        assert [name for _, name in h.events("dispatch")][2:] == ["a2", "a2", "a3", "a3", "a2", "a3"]


async def test_a_group_that_grows_loads_beside_and_drains_the_old_runner(autojump_clock: trio.testing.MockClock) -> None:
    """Three requests hold the group's runner (four slots); a fifth adapter-model (created
    since) is asked: a larger runner loads beside it, the old one serves on meanwhile (a4 takes
    its free slot), and once the new one is ready the old one takes nothing new and stops when
    its requests end. Every request is served."""
    async with running(load_time=5.0) as h:
        options = RunnerOptions(num_parallel=4)
        release = trio.Event()
        old = [await h.hold(MODELS[f"a{i}"], release, options=options) for i in range(1, 4)]
        grown = (*GROUP, "/models/l5.gguf")
        a5 = member("a5", "/models/l5.gguf", group=grown)
        got: list[str] = []
        h.want(a5, got, options=options)
        await trio.testing.wait_all_tasks_blocked()
        assert h.factory.started == 2  # loading beside, not waiting for the three to end
        await trio.sleep(1)  # the new runner is still loading: a4 is served by the old one at once
        during = await h.hold(replace(MODELS["a4"], group=grown), release, options=options)
        assert during.model.adapters == GROUP
        while not got:
            await h.sched.wait_changed()
        assert got == ["a5"] and h.events("evict") == [("evict", "a1")]  # the old runner drains
        after = await h.hold(replace(MODELS["a1"], group=grown), release, options=options)
        assert after.model.adapters == grown  # the new runner takes the group's requests
        assert all(lease.model.adapters == GROUP for lease in old)
        release.set()
        await h.sched.wait_statistics(lambda s: len(s.runners) == 1 and s.leased == 0)
        stats = h.sched.statistics()
        assert stats.runners[0].adapters == grown and stats.loads == 2
        assert h.events("stop") == [("stop", "a1")]


async def test_a_member_asked_with_keep_alive_0_leaves_the_group_warm_for_the_others(autojump_clock: trio.testing.MockClock) -> None:
    async with running() as h:
        async with h.sched.acquire(MODELS["a1"], RunnerOptions(), 300):
            pass
        async with h.sched.acquire(MODELS["a2"], RunnerOptions(), 0):
            pass
        await trio.sleep(1)
        stats = h.sched.statistics()
        assert len(stats.runners) == 1 and [m.name for m in stats.runners[0].members] == ["a1:latest"]
        assert await h.sched.unload(MODELS["a1"])  # the last warm member: the runner goes
        assert h.sched.statistics().runners == ()


def _by_adapters(base: float, per_adapter: float):  # type: ignore[no-untyped-def]
    """An estimator whose runner grows with the adapters it loads (the group's, or a model's own)."""
    from trioshed.core.adapters import runner_model
    from trioshed.core.model import MemoryEstimate

    def estimate(model: ModelSpec, options: RunnerOptions) -> MemoryEstimate:
        total = int((base + per_adapter * len(runner_model(model, embedding=options.embedding).adapters)) * GiB)
        return MemoryEstimate(weights=total, kv=0, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=(total,))

    return estimate


def sized(estimator, *, system: float, max_loaded: int = 0):  # type: ignore[no-untyped-def]
    return harness.running({}, gpus=(), system=system, max_loaded=max_loaded, max_queue=512, estimator=estimator)


async def test_a_group_too_large_for_the_memory_serves_each_model_with_its_own_adapters(autojump_clock: trio.testing.MockClock) -> None:
    """The base is 4 GiB and each adapter 1 GiB; 6 GiB of memory holds the base with one adapter,
    never the group of four: each model gets a runner of its own adapters, and they swap, as
    models without a group do. Nothing fails for want of memory."""
    async with sized(_by_adapters(4, 1), system=6, max_loaded=1) as h:
        for name in ("a1", "a2", "a1"):
            async with h.sched.acquire(MODELS[name], RunnerOptions()) as lease:
                assert lease.model.adapters == MODELS[name].adapters
                assert lease.lora == [{"id": 0, "scale": 1.0}]
        assert h.factory.started == 3
    async with sized(_by_adapters(4, 1), system=16) as h:  # where it fits: the group's one runner
        for name in ("a1", "a2", "a1"):
            async with h.sched.acquire(MODELS[name], RunnerOptions()) as lease:
                assert lease.model.adapters == GROUP
        assert h.factory.started == 1


async def test_a_hot_adapter_set_gets_a_runner_of_its_own_beside_its_group_s(autojump_clock: trio.testing.MockClock) -> None:
    """a1's clients keep both slots of the group's runner busy and more waiting for a minute,
    while a2 has requests too: a runner of a1's adapter alone loads beside (memory allows), and
    a1's requests go there first; a2's stay on the group's runner."""
    from trioshed.core.own_runner import WINDOW

    async with sized(_by_adapters(2, 0.1), system=16) as h:
        options = RunnerOptions(num_parallel=2)
        done = trio.Event()
        served: dict[str, list[tuple[str, ...]]] = {"a1": [], "a2": []}

        async def client(name: str, hold: float) -> None:
            while not done.is_set():
                async with h.sched.acquire(MODELS[name], options) as lease:
                    served[name].append(lease.model.adapters)
                    await trio.sleep(hold)

        own_full_when_group_serves_a1: list[bool] = []
        ready_at = math.inf
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client, "a1", 1.0)
            nursery.start_soon(client, "a2", 1.0)
            await trio.sleep(WINDOW + 0.125)  # sampled between the instants leases change (whole seconds)
            while trio.current_time() < 2 * WINDOW:
                await trio.sleep(0.25)
                runners = {r.adapters: r for r in h.sched.statistics().runners}
                own, group = runners.get(("/models/l1.gguf",)), runners[GROUP]
                if own is None or own.state != "ready":
                    continue
                ready_at = min(ready_at, trio.current_time())
                # (past the leases a1 held on the group's runner before its own was ready)
                if trio.current_time() > ready_at + 2 and any(m.name == "a1:latest" and m.leases for m in group.members):
                    own_full_when_group_serves_a1.append(own.leases == own.slots)
            done.set()
        assert h.factory.started == 2
        assert {r.adapters for r in h.sched.statistics().runners} == {GROUP, ("/models/l1.gguf",)}
        assert ("/models/l1.gguf",) in served["a1"] and set(served["a2"]) == {GROUP}
        # a1 goes to the group's runner only while its own is full
        assert own_full_when_group_serves_a1 and all(own_full_when_group_serves_a1)
