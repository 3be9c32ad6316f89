"""The status page's server side without a browser: ``GET /ui`` and its headers, the key,
``GET /api/events`` (messages, bounded per client, ended by a drain), ``POST /api/pin``, the
log tail. The browser test is ``tests/e2e/test_ui_browser.py``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.api.observe import events, status
from trioshed.api.state import AppState
from trioshed.config import Settings
from trioshed.core.model import Device
from trioshed.devices import DeviceSource
from trioshed.logtail import LogTail
from trioshed.models.store import ModelStore
from trioshed.runner.binary import LlamaBinary
from trioshed.scheduler.events import HISTORY
from trioshed.server import build_scheduler
from trioshed.testing.server import open_test_server

KEY = "ui-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def messages(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """(event, data) of each server-sent event; ("comment", text) for a keep-alive."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            if block.startswith(":"):
                yield "comment", block
                continue
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            yield fields["event"], json.loads(fields["data"])


async def test_page_is_served_without_the_key_with_a_policy_that_loads_nothing_from_elsewhere(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key=KEY) as server, httpx.AsyncClient(base_url=server.urls[0]) as http:
            page = await http.get("/ui")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
            assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
            # every file the page names is one of ours, by path: no host, no CDN
            refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
            assert sorted(refs) == ["/ui/ui.css", "/ui/ui.js"]
            for ref, kind in (("/ui/ui.js", "text/javascript"), ("/ui/ui.css", "text/css")):
                r = await http.get(ref)
                assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
                assert "http://" not in r.text and "https://" not in r.text and "//" + "cdn" not in r.text
            # everything else needs the key, the stream and the page's actions included
            assert (await http.get("/api/events")).status_code == 401
            assert (await http.post("/api/pin", json={"model": "tiny"})).status_code == 401
            # the root stays Ollama's liveness text for clients; a browser gets a link to the page
            assert (await http.get("/")).text == "Ollama is running"
            html = await http.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
            assert 'href="/ui"' in html.text and html.headers["content-type"].startswith("text/html")


async def test_event_stream_sends_hello_state_and_log_then_changes_and_ends_on_drain(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store, api_key=KEY) as server, httpx.AsyncClient(base_url=server.urls[0], headers=AUTH, timeout=30) as http:
            logging.getLogger("trioshed.test").warning("a line before the page")
            async with http.stream("GET", "/api/events") as response, AsyncExitStack() as stack:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                assert response.headers["cache-control"] == "no-cache"
                stream = await stack.enter_async_context(aclosing(messages(response)))
                kind, hello = await anext(stream)
                assert kind == "hello" and hello["models"] == ["tiny:latest"] and hello["instance"] == events.INSTANCE
                kind, state = await anext(stream)
                assert kind == "state" and state["runners"] == [] and state["queue"] == []
                assert [d["id"] for d in state["devices"]] == ["cpu"]
                kind, log = await anext(stream)
                assert kind == "log" and log["lines"][-1]["message"] == "a line before the page"
                # a pin of a model that is not loaded changes nothing there; an unknown one is 404
                r = await http.post("/api/pin", json={"model": "nope"})
                assert r.status_code == 404 and "not found" in r.json()["error"]
                r = await http.post("/api/pin", json={"model": "tiny", "pinned": "yes"})
                assert r.status_code == 400
                assert (await http.post("/api/pin", json={"model": "tiny"})).json() == {"model": "tiny:latest", "pinned": True, "loaded": False}
                logging.getLogger("trioshed.test").warning("a line for the page")
                seen = []
                async for kind, data in stream:
                    seen.append(kind)
                    if kind == "log" and any(line["message"] == "a line for the page" for line in data["lines"]):
                        (line,) = [line for line in data["lines"] if line["message"] == "a line for the page"]
                        assert line["level"] == "WARNING" and line["logger"] == "trioshed.test"
                        break
                # a drain ends the stream at once (an open page must not hold up a restart)
                server.drain.begin()
                async for kind, _ in stream:
                    seen.append(kind)
                assert "hello" not in seen


def _state(tmp_path: Path) -> AppState:
    settings = Settings(models=tmp_path)
    system = Device("cpu", "cpu", 0, 16 << 30, 8 << 30, name="system memory")  # fixed: no state message of its own
    scheduler = build_scheduler(settings, DeviceSource((), "cpu", fixed_system=system), LlamaBinary("/bin/false", {}))
    return AppState(settings=settings, store=ModelStore(tmp_path), scheduler=scheduler, log_tail=LogTail())


async def test_a_client_that_reads_nothing_holds_nothing_and_is_told_what_it_missed(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """A stream keeps only sequence numbers: whatever happens while its reader is away, the next
    messages hold at most the bounded histories' worth, with ``gap`` set."""
    st = _state(tmp_path)
    assert st.log_tail is not None
    history = st.scheduler.events
    stream = events.stream(st, None)
    kinds = []
    while "models" not in kinds:  # the first round: hello, state, ..., the store's models last
        kinds.append((await anext(stream)).split(b"\n", 1)[0].decode().removeprefix("event: "))
    assert kinds[:2] == ["hello", "state"]
    history.add("load", "tiny")
    st.log_tail.emit(logging.LogRecord("trioshed", logging.INFO, __file__, 1, "first", None, None))
    sent = [await anext(stream) for _ in range(2)]
    assert [m.split(b"\n", 1)[0] for m in sent] == [b"event: events", b"event: log"]
    # the reader is away while 5 x HISTORY events and 5 x CAPACITY log lines happen
    for i in range(5 * HISTORY):
        history.add("load", f"m{i}")
    for i in range(5 * st.log_tail.capacity):
        st.log_tail.emit(logging.LogRecord("trioshed", logging.INFO, __file__, 1, "line %d", (i,), None))
    got: dict[str, Any] = {}
    while len(got) < 2:
        message = await anext(stream)
        head, data = message.decode().split("\n", 1)
        got[head.removeprefix("event: ")] = json.loads(data.removeprefix("data: "))
    assert len(got["events"]["events"]) == HISTORY and got["events"]["gap"] is True
    assert got["events"]["events"][-1]["model"] == f"m{5 * HISTORY - 1}"
    assert len(got["log"]["lines"]) == st.log_tail.capacity and got["log"]["gap"] is True
    assert got["log"]["lines"][-1]["message"] == f"line {5 * st.log_tail.capacity - 1}"
    await stream.aclose()
    assert st.event_streams == 0


async def test_refusals_are_folded_and_states_coalesce(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """Many changes while a stream waits become one state message; a flood of the same refusal
    is one event whose count grows."""
    st = _state(tmp_path)
    stream = events.stream(st, None)
    for _ in range(2):
        await anext(stream)  # hello, state
    from trioshed.errors import QueueFull

    for _ in range(1000):
        st.scheduler.events.refused("tiny", QueueFull())
    message = await anext(stream)
    data = json.loads(message.decode().split("\ndata: ", 1)[1])
    (event,) = data["events"]
    assert event["kind"] == "refused" and event["status"] == 503 and event["reason"] == "queue_full"
    assert event["detail"] == "HTTP 503 x1000"
    await stream.aclose()


def test_status_draws_each_device_with_the_runners_on_it() -> None:
    stats = _stats()
    out = status.status(stats, (Device("cuda:0", "cuda", 0, 8 << 30, 6 << 30, name="GPU 0"),),
                        Device("cpu", "cpu", 0, 32 << 30, 20 << 30, name="system memory"),
                        free_known=True, overhead=256 << 20, now=1000.0)  # fmt: skip
    gpu, system = out["devices"]
    assert gpu == {"id": "cuda:0", "name": "GPU 0", "kind": "gpu", "total": 8 << 30, "free": 6 << 30,
                   "reserved": 256 << 20, "up": True, "reason": "", "runners": [{"model": "a", "bytes": 1 << 30}]}  # fmt: skip
    assert system["runners"] == [{"model": "a", "bytes": 100 << 20}] and system["free"] == 20 << 30
    (runner,) = out["runners"]
    assert runner["expires_at"] is None and runner["pinned"] is True and runner["measured"] is None
    assert out["queue"] == [{"model": "b", "key": "", "waiting": 3, "since": 990.0}]
    declared = status.status(stats, (Device("cuda:0", "cuda", 0, 8 << 30, 8 << 30),), Device("cpu", "cpu", 0, 1, 1),
                             free_known=False, overhead=0, now=1000.0)  # fmt: skip
    assert declared["devices"][0]["free"] is None  # accounted only: the page computes it


def _stats() -> Any:
    import math

    from trioshed.core.model import MemoryEstimate, Placement
    from trioshed.scheduler.stats import QueueStats, RunnerStats, SchedulerStatistics

    runner = RunnerStats(
        id=1, model="a", path="/a.gguf", state="ready", leases=0, slots=1, waiting=0, evicting=False, pid=1,
        keep_alive=math.inf, expires_at=math.inf, size=(1 << 30) + (100 << 20), size_vram=1 << 30, context_length=512,
        load_duration=0.5, placement=Placement(n_gpu_layers=2, devices=("cuda:0",)), estimate=MemoryEstimate(weights=1, kv=0, output=0, token_embd=0, compute_full=0, compute_partial=0, layers=()),
        measured=None, usage=(("cuda:0", 1 << 30), ("cpu", 100 << 20)), pinned=True,
    )  # fmt: skip
    return SchedulerStatistics(
        queued=3, leased=0, loaded=1, loading=0, unloading=0, runners=(runner,), loads=1, unloads=0,
        crashes=0, load_failures=0, rejected=0, queue=(QueueStats("b", "", 3, 990.0),),
    )  # fmt: skip


@pytest.mark.parametrize("capacity", [1, 3])
def test_log_tail_keeps_the_last_lines_and_says_when_a_reader_missed_some(capacity: int) -> None:
    tail = LogTail(capacity)
    for i in range(5):
        tail.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "m%d", (i,), None))
    lines, gap = tail.since(0)
    assert [line.message for line in lines] == [f"m{i}" for i in range(5 - capacity, 5)] and gap
    lines, gap = tail.since(4)
    assert [line.message for line in lines] == ["m4"] and not gap
    assert tail.since(5) == ([], False)


def test_log_tail_costs_its_full_size_when_made_and_nothing_per_line_but_its_message() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        tail = LogTail(256)
        made = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/logtail.py")])
        for _ in range(256):
            tail.emit(logging.LogRecord("trioshed.scheduler", logging.INFO, __file__, 1, "%s", ("x" * 40,), None))
        full = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/logtail.py")])
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in full.compare_to(made, "filename"))
    assert grown < 2048, f"{grown} bytes for 256 lines held"  # an object per line: ~20 KB
    lines, _ = tail.since(0)
    assert len(lines) == 256 and lines[0].logger == "trioshed.scheduler" and lines[0].level == "INFO"


async def test_streams_are_counted_a_vanished_client_ends_its_stream_and_the_limit_is_a_503(
    model_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "MAX_STREAMS", 1)
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.urls[0], timeout=30) as http:
            async with http.stream("GET", "/api/events") as response, aclosing(messages(response)) as stream:
                assert (await anext(stream))[0] == "hello"
                assert server.state.event_streams == 1
                busy = await http.get("/api/events")
                assert busy.status_code == 503 and busy.headers["Retry-After"] and "status pages" in busy.json()["error"]
            # the client left (connection closed): its stream ends and frees its place
            await server.drain.wait_idle()  # no request in flight: the stream's handler returned
            assert server.state.event_streams == 0
            async with http.stream("GET", "/api/events") as response:
                assert response.status_code == 200
