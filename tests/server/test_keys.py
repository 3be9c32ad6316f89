"""API keys (trioshed.keys): the keys file, constant-time identification, requests per minute;
per-key limits and fair shares through the scheduler (MockClock, fake runners); 401/429 over
HTTP from a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from tests.scheduler.harness import running, spec
from trioshed.core.model import RunnerOptions
from trioshed.errors import TooManyRequests
from trioshed.keys import (
    ANONYMOUS,
    ApiKey,
    KeyRing,
    RequestRate,
    current_key,
    keyring,
    load_keys_file,
)
from trioshed.testing.server import open_test_server

KEYS = """
[[key]]
name = "alice"
key = "alice-secret-1"
weight = 2
max_concurrent = 4
max_queued = 2
requests_per_minute = 3

[[key]]
name = "bob"
key = "bob-secret-22"
"""


def test_the_keys_file_gives_names_weights_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    alice, bob = load_keys_file(path)
    assert (alice.name, alice.weight, alice.max_concurrent, alice.max_queued, alice.requests_per_minute) == ("alice", 2, 4, 2, 3)
    assert (bob.name, bob.weight, bob.max_concurrent) == ("bob", 1, 0)
    assert "secret" not in repr(alice)  # a key never reaches a log line through repr
    ring = keyring("env-key-333", path)
    assert [k.name for k in ring.keys] == ["default", "alice", "bob"]  # TRIOSHED_API_KEY is one key
    assert ring.identify("bob-secret-22") == bob
    assert ring.identify("env-key-333") is not None and ring.identify("env-key-333").name == "default"  # type: ignore[union-attr]
    assert ring.identify("bob-secret-2") is None and ring.identify("") is None
    assert not KeyRing().required and keyring(None, None).identify("x") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[key]]\nname = "a"\n', "key must be a string of at least 8"),
        ('[[key]]\nname = "a b"\nkey = "12345678"\n', "name must be"),
        ('[[key]]\nname = "a"\nkey = "12345678"\nweight = 0\n', "weight must be a positive"),
        ('[[key]]\nname = "a"\nkey = "12345678"\nmax_queued = -1\n', "max_queued must be a whole number"),
        ('[[key]]\nname = "a"\nkey = "12345678"\nlimit = 3\n', "unknown field limit"),
        ('[keys]\nname = "a"\n', "unknown table keys"),
        ('[[key]]\nname = "a"\nkey = "12345678"\n[[key]]\nname = "a"\nkey = "87654321"\n', "names must be unique"),
    ],
)
def test_a_bad_keys_file_is_named_with_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        keyring(None, path)


def test_requests_per_minute_is_a_sliding_window() -> None:
    rate, key = RequestRate(), ApiKey("a", "12345678", requests_per_minute=2)
    assert rate.admit(key, 0.0) is None and rate.admit(key, 10.0) is None
    assert rate.admit(key, 30.0) == 30  # the first leaves the window at 60 s
    assert rate.admit(key, 60.5) is None
    assert rate.admit(ANONYMOUS, 0.0) is None


async def as_key(key: ApiKey, fn: object) -> None:
    current_key.set(key)
    await fn()  # type: ignore[operator]


async def test_per_key_limits_refuse_with_429(autojump_clock: trio.testing.MockClock) -> None:
    alice = ApiKey("alice", "alice-secret-1", max_concurrent=3, max_queued=1)
    async with running({"a": 1}, load_time=2) as h:
        outcomes: list[str] = []

        async def one() -> None:
            try:
                async with h.sched.acquire(spec("a"), RunnerOptions(), key=alice):
                    outcomes.append("ok")
                    await trio.sleep(5)
            except TooManyRequests as exc:
                outcomes.append(exc.message)
                assert exc.headers["Retry-After"] == "1" and exc.status == 429

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)  # queued while a loads
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one)  # a second queued: over max_queued
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(3)  # loaded: the first holds its slot
            for _ in range(3):  # a slot each (1 slot: they queue; the second over max_queued)
                nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()
        assert outcomes[0].startswith("API key 'alice' reached its limit of 1 queued requests")
        assert outcomes.count("ok") == 2
        refusals = [e for e in h.sched.events.after(0) if e.kind == "refused"]
        assert {(e.status, e.reason) for e in refusals} == {(429, "too_many_requests")}
        assert h.sched.statistics().tenants[0].key == "alice"


async def flood_waits(fair: bool) -> dict[str, list[float]]:
    """One runner, 2 slots, each request holds its slot 1 s; alice floods 16 requests, then bob
    sends 4 (as themselves, or all as one tenant when not ``fair``). Each request's wait."""
    alice, bob = ApiKey("alice", "alice-secret-1"), ApiKey("bob", "bob-secret-22")
    two = RunnerOptions(num_parallel=2)
    async with running({"a": 1}, load_time=1, max_queue=64) as h:
        await h.once("a", options=two)
        waits: dict[str, list[float]] = {"alice": [], "bob": []}

        async def one(key: ApiKey) -> None:
            t0 = trio.current_time()
            async with h.sched.acquire(spec("a"), two, key=key if fair else ANONYMOUS):
                waits[key.name].append(trio.current_time() - t0)
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            for key in [alice] * 16 + [bob] * 4:
                nursery.start_soon(one, key)
                await trio.testing.wait_all_tasks_blocked()
        return waits


async def test_a_flooding_key_cannot_push_another_back_beyond_its_share(autojump_clock: trio.testing.MockClock) -> None:
    # bob is half the demand while he waits: his 4 get a slot within 4 s; alice's flood takes
    # the other slots and ends when it would have
    fair = await flood_waits(True)
    assert max(fair["bob"]) <= 4 and max(fair["alice"]) == 9, fair
    assert min((await flood_waits(False))["bob"]) >= 8  # arrival order: after all 16 of alice's


async def test_a_weight_gives_a_key_that_share(autojump_clock: trio.testing.MockClock) -> None:
    heavy, light = ApiKey("heavy", "heavy-secret", weight=4), ApiKey("light", "light-secret")
    async with running({"a": 1}, load_time=1, max_queue=64) as h:
        one_slot = RunnerOptions(num_parallel=1)
        await h.once("a", options=one_slot)
        served: list[str] = []

        async def one(key: ApiKey) -> None:
            async with h.sched.acquire(spec("a"), one_slot, key=key):
                served.append(key.name)
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            for key in [light] * 8 + [heavy] * 8:
                nursery.start_soon(one, key)
                await trio.testing.wait_all_tasks_blocked()
        # the first light one took the free slot; then 4 heavy for each light while both wait
        assert served[:11] == ["light"] + (["heavy"] * 4 + ["light"]) * 2, served


async def test_keys_over_http_401_429_and_the_env_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    store = tmp_path / "models"
    store.mkdir()
    with trio.fail_after(60):
        async with open_test_server(store, api_key="env-key-333", keys_file=keys) as server:
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                assert (await http.get("/api/tags")).status_code == 401
                assert (await http.get("/api/tags", headers={"Authorization": "Bearer nope-nope"})).status_code == 401
                env = {"Authorization": "Bearer env-key-333"}
                assert (await http.get("/api/tags", headers=env)).status_code == 200
                alice = {"Authorization": "Bearer alice-secret-1"}
                codes = [(await http.get("/api/tags", headers=alice)).status_code for _ in range(3)]
                assert codes == [200, 200, 200]
                r = await http.get("/api/tags", headers=alice)
                assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
                assert "API key 'alice' reached its limit of 3 requests per minute" in r.json()["error"]
                assert (await http.get("/api/tags", headers={"Authorization": "Bearer bob-secret-22"})).status_code == 200
                metrics = (await http.get("/metrics", headers=env)).text
                assert "alice-secret-1" not in metrics and "bob-secret-22" not in metrics
                assert 'trioshed_key_requests_total{key="alice",status="429"} 1.0' in metrics
                assert 'trioshed_key_requests_total{key="alice",status="200"} 3.0' in metrics


FAIR_KEYS = """
[[key]]
name = "heavy"
key = "heavy-secret-1"
weight = 3

[[key]]
name = "light"
key = "light-secret-1"
weight = 1
"""


async def test_weighted_fair_shares_with_a_real_runner(model_store: Path, tmp_path: Path) -> None:
    """Two tenants keep one real runner's single slot busy, four requests each always waiting:
    the answers they get follow their weights (3:1), whoever sent first (the MockClock
    tests above, here end to end with a llama-server child)."""
    keys = tmp_path / "fair.toml"
    keys.write_text(FAIR_KEYS)
    body = {"model": "tiny", "prompt": "hi", "raw": True, "stream": False, "options": {"num_predict": 48, "temperature": 0}}
    served: list[str] = []
    with trio.fail_after(240):
        async with open_test_server(model_store, keys_file=keys, num_parallel=1, max_queue=64) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
                warm = await http.post("/api/generate", json=body, headers={"x-api-key": "light-secret-1"})
                assert warm.status_code == 200, warm.text  # loaded: from now on only the slot is scarce
                done = trio.Event()

                async def client(name: str, key: str) -> None:
                    while not done.is_set():
                        r = await http.post("/api/generate", json=body, headers={"x-api-key": key})
                        assert r.status_code == 200, r.text
                        served.append(name)
                        if served.count("heavy") >= 36:
                            done.set()

                async with trio.open_nursery() as nursery:
                    for _ in range(4):  # the light tenant first: its head start is not a bigger share
                        nursery.start_soon(client, "light", "light-secret-1")
                    await trio.sleep(0.05)
                    for _ in range(4):
                        nursery.start_soon(client, "heavy", "heavy-secret-1")
    first = served.index("heavy")  # from here on both tenants have requests waiting
    window = served[first : first + 40]
    share = window.count("heavy") / len(window)
    assert len(window) == 40 and 0.62 <= share <= 0.88, (share, " ".join(n[0] for n in served))  # 3:1 is 0.75; 1:1 gives 0.5


def test_the_store_s_keys_merge_with_the_file_s_in_the_file_s_order() -> None:
    from trioshed.keys import digest, merge

    file = [ApiKey("ops", "ops-secret-1", role="admin"), ApiKey("ann", "ann-secret-1"), ApiKey("old", "old-secret-1")]
    stored = [  # the store's copies come by name: the imported ann (updated there), a key made over the API
        ApiKey("ann", "", tokens_per_day=5, digest=digest("ann-secret-1")),
        ApiKey("bob", "", digest=digest("bob-secret-1")),
        ApiKey("cid", "", digest=digest("ops-secret-1")),  # holds ops's secret: the store's wins
    ]
    keys = merge(file, stored, revoked=frozenset({"old"}))
    assert [(k.name, k.tokens_per_day) for k in keys] == [("ann", 5), ("bob", 0), ("cid", 0)]
    assert [k.name for k in merge(file, stored[:2])] == ["ops", "ann", "old", "bob"]  # the file's order, then the store's own
