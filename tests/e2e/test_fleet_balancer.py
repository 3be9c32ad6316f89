"""No whole request is lost when any node dies, the node a request entered on included: three real
``trioshed serve`` processes forming a fleet behind the packaged HAProxy configuration, a model
warm on one of them, 15 whole requests sent to the balancer (entering on every node), that node
SIGKILLed while they run: every request answers 200 with all its tokens, five times over, each
time another node warm and killed. HAProxy's own counts show that the requests entered on every
node and that it sent some again (those the killed node had taken)."""

from __future__ import annotations

import csv
import io
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.haproxy import needs_haproxy, run_haproxy
from tests.support.serve_process import ServeProcess, serve_process
from trioshed.testing.llama import free_port

pytestmark = [pytest.mark.slow, needs_haproxy]

SECRET = "fleet-balancer-test-secret"
NAMES = ("A", "B", "C")  # HAProxy's node1, node2, node3
REQUESTS = 15
TOKENS = 400
ROUNDS = 5


async def stats(port: int) -> dict[str, dict[str, str]]:
    """HAProxy's ``show stat`` of the fleet backend, by server name (``BACKEND``: its totals)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"show stat\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    return {r["svname"]: r for r in rows if r["pxname"] == "trioshed_fleet"}


def server(name: str) -> str:
    return f"node{NAMES.index(name) + 1}"


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Until ``await check()`` holds; the round's deadline bounds it."""
    while not await check():  # noqa: ASYNC110  # other processes, looked at over HTTP every 0.1 s
        await trio.sleep(0.1)


class Fleet:
    """The three node processes, HAProxy's front and its stats socket."""

    def __init__(self, http: httpx.AsyncClient, urls: dict[str, str], front: str, stats_port: int) -> None:
        self.http = http
        self.urls = urls
        self.front = front
        self.stats_port = stats_port

    async def loaded(self, observer: str) -> dict[str, list[str]]:
        """Each node's loaded models as ``observer`` sees the fleet (``/api/ps``'s nodes)."""
        nodes = (await self.http.get(self.urls[observer] + "/api/ps")).json()["nodes"]
        return {n["name"]: [m["model"] for m in n["loaded"]] if n["reachable"] else ["unreachable"] for n in nodes}

    async def warm_on(self, warm: str) -> None:
        """m1 loaded on ``warm`` only, every node seeing it so, every node up for HAProxy."""
        others = [n for n in NAMES if n != warm]

        async def alone() -> bool:  # the other nodes' copies of the last round expired (keep-alive 1 s)
            return [(await self.loaded(o))[o] for o in others] == [[], []]

        await until(alone)
        body = {"model": "m1", "prompt": "hi", "stream": False, "keep_alive": "5m", "options": {"num_predict": 2}}
        assert (await self.http.post(self.urls[warm] + "/api/generate", json=body)).status_code == 200

        async def seen() -> bool:
            views = [await self.loaded(o) for o in others]
            return all(v[warm] == ["m1:latest"] and [v[o] for o in others] == [[], []] for v in views)

        async def up() -> bool:
            now = await stats(self.stats_port)
            return all(now[server(n)]["status"] == "UP" for n in NAMES)

        await until(seen)
        await until(up)

    async def load_and_kill(self, warm: ServeProcess, round_: int) -> tuple[list[tuple[int, int]], dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """REQUESTS whole requests through the balancer, ``warm`` SIGKILLed once all entered: each
        answer's status and tokens, and HAProxy's counts before and after."""
        before = await stats(self.stats_port)
        results: list[tuple[int, int]] = []

        async def one(i: int) -> None:
            job = {"prompt": f"round {round_} request {i}", "n_predict": TOKENS, "ignore_eos": True}
            r = await self.http.post(self.front + "/upstream/m1/completion", json=job)
            results.append((r.status_code, r.json()["tokens_predicted"] if r.status_code == 200 else -1))

        async def entered() -> bool:  # every request is in a node's hands
            return int((await stats(self.stats_port))["BACKEND"]["stot"]) - int(before["BACKEND"]["stot"]) >= REQUESTS

        async with trio.open_nursery() as nursery:
            for i in range(REQUESTS):
                nursery.start_soon(one, i)
            await until(entered)
            warm.process.kill()  # SIGKILL: it holds requests it took from the balancer and requests forwarded to it
        return results, before, await stats(self.stats_port)


async def test_a_node_killed_behind_the_balancer_loses_no_whole_request(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "m1")
    ports = {name: free_port() for name in NAMES}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    stats_port = free_port()
    env = {
        "TRIOSHED_PEERS": ",".join(urls.values()), "TRIOSHED_FLEET_SECRET": SECRET, "TRIOSHED_FLEET_INTERVAL": "0.1",
        "TRIOSHED_FLEET_STALE": "2", "TRIOSHED_KEEP_ALIVE": "1s", "TRIOSHED_KV_CACHE_BUDGET": "0",
    }  # fmt: skip

    def start(name: str) -> AbstractAsyncContextManager[ServeProcess]:
        return serve_process(store, ports[name], TRIOSHED_NODE_NAME=name, TRIOSHED_USAGE_DB=str(tmp_path / f"{name}.db"), **env)

    async with AsyncExitStack() as stack:
        procs: dict[str, ServeProcess] = {}
        for name in NAMES:
            procs[name] = await stack.enter_async_context(start(name))
        front = await stack.enter_async_context(run_haproxy(tmp_path, list(urls.values()), "trioshed_fleet", stats_port=stats_port))
        async with httpx.AsyncClient(timeout=120) as http:
            fleet = Fleet(http, urls, front, stats_port)
            for round_ in range(ROUNDS):
                warm = NAMES[(round_ + 1) % 3]  # B, C, A, B, C
                with trio.fail_after(90):
                    await fleet.warm_on(warm)
                    results, before, after = await fleet.load_and_kill(procs[warm], round_)
                    assert results == [(200, TOKENS)] * REQUESTS, (round_, warm, results)
                    sent = {n: int(after[server(n)]["stot"]) - int(before[server(n)]["stot"]) for n in NAMES}
                    assert all(sent[n] >= 1 for n in NAMES), sent  # the requests entered on every node
                    again = sum(int(after["BACKEND"][c]) - int(before["BACKEND"][c]) for c in ("wretr", "wredis"))
                    assert again >= 1, "the balancer sent nothing again: the killed node held none of its requests"
                    assert await procs[warm].wait_exit() != 0
                    procs[warm] = await stack.enter_async_context(start(warm))  # back for the next round
