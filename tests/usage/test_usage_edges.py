"""Usage at the edges: a request that ends while ``serve()`` is being cancelled is still written;
reading usage from a damaged database is the documented 503; a time that is not finite is a 400."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import Spend
from trioshed.usage.recorder import UsageRecorder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]


async def test_a_request_ending_as_serve_is_cancelled_is_recorded(model_store: Path, tmp_path: Path) -> None:
    """A stream in flight when serve() is cancelled from outside ends during that cancellation;
    its usage row is written by the final flush, which now waits for every request."""
    db = tmp_path / "usage.db"
    body = {"model": "tiny", "prompt": "hello", "stream": True, "options": {"num_predict": 100000, "temperature": 0}}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            streaming = trio.Event()

            async def stream(url: str) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    async with http.stream("POST", "/api/generate", json=body) as answer:
                        async for _ in answer.aiter_lines():
                            streaming.set()
                            await trio.sleep_forever()  # the server is stopped under it

            async with open_test_server(model_store, usage_db=db) as server:
                nursery.start_soon(stream, server.base_url)
                await streaming.wait()
            nursery.cancel_scope.cancel()  # serve() was cancelled (the block's exit) and has returned
    usage = UsageDB(db)
    await trio.to_thread.run_sync(usage.open)
    try:
        rows = await trio.to_thread.run_sync(lambda: usage.query(by="day"))
    finally:
        await trio.to_thread.run_sync(usage.close)
    assert [(r["model"], r["requests"]) for r in rows] == [("tiny:latest", 1)]


async def test_since_and_until_must_be_finite_times(model_store: Path, tmp_path: Path) -> None:
    async with open_test_server(model_store, usage_db=tmp_path / "usage.db") as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            for name in ("since", "until"):
                for value in ("nan", "NaN", "inf", "-inf", "1e999", "tomorrow-ish"):
                    answer = await http.get("/api/usage", params={name: value})
                    assert answer.status_code == 400, (name, value, answer.text)
                    assert answer.json()["error"].startswith(f"{name}=")
            assert (await http.get("/api/usage", params={"since": "0", "until": "2026-12-31"})).status_code == 200


async def test_a_sqlite_error_reading_usage_is_503_in_ollamas_shape(model_store: Path, tmp_path: Path) -> None:
    """Another program renames the table the server reads (a real SQLite error on a database the
    server has open); moved back, usage reads again."""
    db = tmp_path / "usage.db"
    async with open_test_server(model_store, usage_db=db) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/api/usage")).status_code == 200  # opened, read
            other = sqlite3.connect(db, isolation_level=None)
            try:
                other.execute("ALTER TABLE usage_day RENAME TO usage_day_elsewhere")
                answer = await http.get("/api/usage")
                other.execute("ALTER TABLE usage_day_elsewhere RENAME TO usage_day")
            finally:
                other.close()
            assert answer.status_code == 503, answer.text
            error = json.loads(answer.content)["error"]
            assert error == "usage cannot be read now: the usage database cannot be used: no such table: usage_day"
            assert (await http.get("/api/usage")).status_code == 200


class _SlowToFail(UsageDB):
    """A SQLite store whose next write hangs until told, then fails as an unreachable server does
    (a connect that waits its timeout): the rows of that batch are on their way, not written."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writing = threading.Event()
        self.fail = threading.Event()

    def write(self, spends: list[Spend], now: float, node: str = "") -> None:
        self.writing.set()
        self.fail.wait(30)
        raise OSError("connection to server failed: Connection refused")


async def test_rows_being_written_still_count_as_waiting(tmp_path: Path) -> None:
    """While a write is under way (to a database that has just gone away, it can take seconds to
    fail) its rows are not in memory's list but not in the store either: the status counts them."""
    store = _SlowToFail(tmp_path / "usage.db")
    recorder = UsageRecorder(store, interval=3600)
    for _ in range(5):
        recorder.record(Spend("ann", "tiny", time.time(), prompt=1, completion=1))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recorder.flush)
            try:
                await trio.to_thread.run_sync(store.writing.wait)
                recorder.record(Spend("ann", "tiny", time.time(), prompt=1, completion=1))
                status = recorder.statistics()
                assert status is not None and status.pending == 6 and len(recorder.pending) == 1
            finally:
                store.fail.set()
    status = recorder.statistics()
    assert status is not None and status.pending == 6 and status.problem == "is unreachable"
    await trio.to_thread.run_sync(store.close)
