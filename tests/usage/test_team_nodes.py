"""Three trioshed nodes on loopback sharing one real PostgreSQL (in-process servers; no model is
needed: the gate answers before a runner would): a key made on one node works on another, a
revoke reaches every node within the keys' refresh, a budget spent on two nodes refuses the next
request on the third, and the database stopped under load and started again loses no usage row.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.postgres import fresh_database, needs_postgres, postgres  # noqa: F401
from trioshed.cli import main
from trioshed.server import Server
from trioshed.testing.postgres import PASSWORD, Postgres, running_postgres
from trioshed.testing.server import open_test_server
from trioshed.usage.keysync import KEYS_REFRESH
from trioshed.usage.ledger import Spend

pytestmark = needs_postgres
BOSS = {"Authorization": "Bearer boss-secret-1"}
ASK = {"model": "nothing-here", "prompt": "hi", "stream": False}


@asynccontextmanager
async def nodes(tmp_path: Path, url: str, n: int = 3) -> AsyncIterator[list[Server]]:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    async with AsyncExitStack() as stack:
        out = []
        for name in "abc"[:n]:
            out.append(await stack.enter_async_context(
                open_test_server(models, api_key="boss-secret-1", database=url, node_name=name)
            ))  # fmt: skip
        yield out


async def status(server: Server, method: str, path: str, headers: dict[str, str], **kw: object) -> int:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        return (await client.request(method, path, headers=headers, **kw)).status_code  # type: ignore[arg-type]


async def test_keys_made_on_one_node_work_on_another_and_a_revoke_reaches_all(postgres: Postgres, tmp_path: Path) -> None:  # noqa: F811
    async with nodes(tmp_path, fresh_database(postgres)) as (a, b, c):
        async with httpx.AsyncClient(base_url=a.base_url, timeout=30) as client:
            made = await client.post("/api/keys", headers=BOSS, json={"name": "ann", "models": ["tiny*"]})
            assert made.status_code == 201, made.text
            secret = made.json()["key"]
            assert (await client.post("/api/keys", headers=BOSS, json={"name": "ann"})).status_code == 409
            listed = (await client.get("/api/keys", headers=BOSS)).json()["keys"]
            assert [k["name"] for k in listed] == ["ann"] and secret not in str(listed)
        ann = {"Authorization": f"Bearer {secret}"}
        assert await status(a, "GET", "/api/tags", ann) == 200  # in force on its node at once
        with trio.fail_after(KEYS_REFRESH + 3):
            while await status(c, "GET", "/api/tags", ann) != 200:  # noqa: ASYNC110  # polling another node over HTTP
                await trio.sleep(0.1)
        assert await status(c, "GET", "/api/keys", ann) == 403  # a user key: no key management
        assert await status(c, "POST", "/api/generate", ann, json=ASK) == 404  # the fast path knows it: past the gate
        assert await status(b, "DELETE", "/api/keys/ann", BOSS) == 200
        revoked = time.monotonic()
        for node in (a, b, c):
            while await status(node, "GET", "/api/tags", ann) != 401:
                assert time.monotonic() - revoked < KEYS_REFRESH + 1.5, "a revoke took longer than its bound"
                await trio.sleep(0.05)
        assert await status(c, "POST", "/api/generate", ann, json=ASK) == 401  # the fast path's ring too
        assert await status(a, "DELETE", "/api/keys/ann", BOSS) == 404


async def test_a_budget_spent_on_two_nodes_refuses_the_next_request_on_the_third(postgres: Postgres, tmp_path: Path) -> None:  # noqa: F811
    async with nodes(tmp_path, fresh_database(postgres)) as (a, b, c):
        async with httpx.AsyncClient(base_url=a.base_url, timeout=30) as client:
            made = await client.post("/api/keys", headers=BOSS, json={"name": "ann", "tokens_per_day": 100})
        ann = {"Authorization": f"Bearer {made.json()['key']}"}
        with trio.fail_after(KEYS_REFRESH + 3):
            while await status(c, "GET", "/api/tags", ann) != 200:  # noqa: ASYNC110  # polling another node over HTTP
                await trio.sleep(0.1)
        assert await status(c, "POST", "/api/generate", ann, json=ASK) == 404  # past the budget check: no such model
        for node in (a, b):  # 60 tokens on each: 120 of 100, neither node over it alone
            assert node.state.usage is not None
            node.state.usage.record(Spend("ann", "tiny", time.time(), prompt=40, completion=20))
        spent = time.monotonic()
        assert await status(a, "POST", "/api/generate", ann, json=ASK) == 404  # a alone knows 60
        while (code := await status(c, "POST", "/api/generate", ann, json=ASK)) != 429:  # the fast path
            assert code == 404
            assert time.monotonic() - spent < 2 * c.state.usage.interval + 1.5, "the team's spend took longer than its bound"  # type: ignore[union-attr]
            await trio.sleep(0.05)
        assert await status(c, "POST", "/api/embed", ann, json={"model": "nothing-here", "input": "hi"}) == 429  # Quart's path
        assert await status(c, "POST", "/api/embed", BOSS, json={"model": "nothing-here", "input": "hi"}) == 404
        async with httpx.AsyncClient(base_url=b.base_url, timeout=30) as client:  # any node answers for the team
            body = (await client.get("/api/usage", headers=BOSS)).json()
        assert [(r["node"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in body["usage"]] == [
            ("a", 1, 40, 20), ("b", 1, 40, 20)]  # fmt: skip
        assert body["database"]["kind"] == "postgresql" and PASSWORD not in str(body)
        async with httpx.AsyncClient(base_url=c.base_url, timeout=30) as client:
            csv = (await client.get("/api/usage", headers=BOSS, params={"format": "csv"})).text.splitlines()
        assert csv[0].endswith(",seconds,node") and [line.rsplit(",", 1)[1] for line in csv[1:]] == ["a", "b"]


async def said(node: Server) -> tuple[dict[str, Any], dict[str, Any], str]:
    """What a node says of its database: in ``/api/ps``, in the status page's first state
    message (``/api/events``) and in ``/metrics``."""
    async with httpx.AsyncClient(base_url=node.base_url, timeout=30) as client:
        ps = (await client.get("/api/ps", headers=BOSS)).json()
        metrics = (await client.get("/metrics", headers=BOSS)).text
        async with client.stream("GET", "/api/events", headers=BOSS) as events:
            lines = events.aiter_lines()
            async for line in lines:
                if line == "event: state":
                    page = json.loads((await anext(lines)).removeprefix("data: "))
                    break
    return ps["database"], page["database"], metrics


async def test_the_database_stopped_under_load_loses_no_usage_row(tmp_path: Path) -> None:
    with running_postgres() as pg:  # its own server: this test stops it
        async with nodes(tmp_path, fresh_database(pg)) as servers:
            sent = 0

            async def load(seconds: float) -> None:
                nonlocal sent
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for node in servers:
                        node.state.usage.record(Spend("ann", "tiny", time.time(), prompt=1, completion=1))  # type: ignore[union-attr]
                        sent += 1
                    await trio.sleep(0.01)

            await load(1.5)
            await trio.to_thread.run_sync(pg.stop)
            with trio.fail_after(30):  # each node finds out at its next write or read (a connect waits up to 2 s)
                while not all(n.state.usage.problem == "is unreachable" for n in servers):  # type: ignore[union-attr]
                    await load(0.2)
            await load(1.0)
            assert any(n.state.usage.pending for n in servers)  # type: ignore[union-attr]
            down = await said(servers[0])
            assert down[0]["reachable"] is False and down[0]["problem"] == "is unreachable" and down[0]["pending"] > 0
            assert down[1] == down[0]  # the status page says what /api/ps says
            assert 'trioshed_database_up{kind="postgresql"} 0.0' in down[2] and PASSWORD not in str(down)
            await trio.to_thread.run_sync(pg.start)
            await load(1.5)
            with trio.fail_after(20):
                while any(n.state.usage.pending or n.state.usage.problem for n in servers):  # type: ignore[union-attr]  # noqa: ASYNC110
                    await trio.sleep(0.1)
            up = await said(servers[0])
            assert up[0]["reachable"] is True and up[0]["pending"] == 0 and up[0]["problem"] is None
            assert 'trioshed_database_up{kind="postgresql"} 1.0' in up[2] and "trioshed_usage_rows_dropped_total 0.0" in up[2]
            rows = await servers[2].state.usage.query()  # type: ignore[union-attr]
            assert sum(r["requests"] for r in rows) == sent and sum(r["prompt_tokens"] for r in rows) == sent
            assert all(n.state.usage.dropped == 0 for n in servers)  # type: ignore[union-attr]


async def test_the_keys_command(postgres: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811


    async with nodes(tmp_path, fresh_database(postgres), n=1) as (a,):
        monkeypatch.setenv("TRIOSHED_HOST", a.base_url.removeprefix("http://"))
        monkeypatch.setenv("TRIOSHED_API_KEY", "boss-secret-1")

        async def cli(*argv: str) -> tuple[int, str]:
            code = await trio.to_thread.run_sync(main, list(argv))
            out = capsys.readouterr()
            return code, out.out + out.err

        code, out = await cli("keys", "create", "bob", "--tokens-per-day", "500", "--models", "tiny*")
        secret = out.split()[-1]
        assert code == 0 and secret.startswith("tsk-")
        code, out = await cli("keys", "list")
        assert code == 0 and "bob" in out and "500" in out and secret not in out
        assert (await cli("keys", "update", "bob", "--tokens-per-day", "0"))[0] == 0
        code, out = await cli("keys", "rotate", "bob")
        assert code == 0 and out.split()[-1] != secret
        assert await status(a, "GET", "/api/tags", {"Authorization": f"Bearer {secret}"}) == 401  # the old secret
        assert (await cli("keys", "revoke", "bob"))[0] == 0
        code, out = await cli("keys", "revoke", "bob")
        assert code == 1 and "Error: no API key 'bob'" in out
