"""TRIOSHED_LOG_FORMAT=json: one JSON line per request on ``trioshed.requests``; nothing per
request at INFO in text mode."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from trioshed.config import Settings
from trioshed.logs import JsonFormatter, use_format
from trioshed.testing.server import open_test_server

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}


def test_log_format_setting() -> None:
    assert Settings.from_env({}).log_format == "text"
    assert Settings.from_env({"TRIOSHED_LOG_FORMAT": "JSON"}).log_format == "json"
    with pytest.raises(ValueError, match="TRIOSHED_LOG_FORMAT='xml': use text or json"):
        Settings.from_env({"TRIOSHED_LOG_FORMAT": "xml"})


def test_json_formatter_puts_fields_at_the_top_level() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    saved, root.handlers = root.handlers, [handler]  # pytest's own handlers keep their format
    try:
        use_format("json")  # what `trioshed serve` does with TRIOSHED_LOG_FORMAT=json
        assert isinstance(handler.formatter, JsonFormatter)
        logger = logging.getLogger("trioshed.test")
        logger.warning("load %s", "tiny", extra={"fields": {"model": "tiny", "status": 200}})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        root.handlers = saved
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "load tiny" and first["level"] == "WARNING" and first["logger"] == "trioshed.test"
    assert first["model"] == "tiny" and first["status"] == 200 and first["time"].endswith("Z")
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in caplog.records if r.name == "trioshed.requests"]


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_json_mode_logs_one_line_per_request(model_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trioshed.requests")
    with trio.fail_after(120):
        async with open_test_server(model_store, log_format="json") as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": FAST})
            answer = r.json()
            async with http.stream("POST", "/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": FAST}) as streamed:
                chunks = [json.loads(line) async for line in streamed.aiter_lines() if line]
            assert (await http.post("/api/generate", json={"model": "nope", "prompt": "x"})).status_code == 404
            await http.get("/api/version")
    generate, chat, missing, version = request_lines(caplog)
    assert generate["event"] == "request" and generate["method"] == "POST" and generate["route"] == "/api/generate"
    assert generate["status"] == 200 and generate["model"] == "tiny:latest"
    assert generate["prompt_tokens"] == answer["prompt_eval_count"] and generate["eval_tokens"] == answer["eval_count"]
    assert isinstance(generate["load_wait_ms"], float) and generate["load_wait_ms"] > 0  # the first request loaded it
    assert isinstance(generate["queue_wait_ms"], float) and generate["queue_wait_ms"] >= generate["load_wait_ms"]
    assert isinstance(generate["duration_ms"], float) and generate["duration_ms"] >= generate["queue_wait_ms"]
    host, _, port = str(generate["client"]).partition(":")
    assert host == "127.0.0.1" and port.isdigit() and f":{port}" not in server.base_url
    assert chat["route"] == "/api/chat" and chat["status"] == 200 and chat["load_wait_ms"] == 0
    assert chat["eval_tokens"] == chunks[-1]["eval_count"]  # streamed: counted from the final chunk
    assert missing["status"] == 404 and missing["model"] is None and missing["queue_wait_ms"] is None
    assert version["route"] == "/api/version" and version["status"] == 200 and version["prompt_tokens"] is None


async def test_text_mode_logs_nothing_per_request_at_info(model_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trioshed.requests")
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/api/version")).status_code == 200
            assert (await http.get("/api/tags")).status_code == 200
    assert request_lines(caplog) == []
    caplog.set_level(logging.DEBUG, logger="trioshed.requests")  # -v: a short text line each
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            await http.get("/api/version")
    assert [r.getMessage().split(" 200 ")[0] for r in caplog.records if r.name == "trioshed.requests"] == ["GET /api/version"]


def test_client_addresses_read_unambiguously() -> None:
    from trioshed.api.observe.request_log import _address

    assert _address(("127.0.0.1", 5000)) == "127.0.0.1:5000"
    assert _address(("::1", 5000)) == "[::1]:5000"
    assert _address(None) == ""  # a unix socket, or a server that does not say


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_serve_in_json_mode_writes_only_json_lines(model_store: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "TRIOSHED_LOG_FORMAT": "json", "TRIOSHED_NUM_THREAD": "1"}
    argv = [sys.executable, "-m", "trioshed", "serve", "--host", f"127.0.0.1:{port}", "--models", str(model_store)]
    with trio.fail_after(120), log.open("wb") as out:
        proc = await trio.lowlevel.open_process(argv, stdout=out, stderr=out, env=env)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                for _ in range(600):  # start-up: up to a minute
                    try:
                        await http.get("/api/version")
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.1)
                r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": FAST})
                assert r.status_code == 200
        finally:
            proc.send_signal(signal.SIGINT)
            await proc.wait()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]  # each one JSON
    assert proc.returncode == 0
    assert any(line["message"].startswith("trioshed ") and "serving" in line["message"] for line in lines)
    (request,) = [line for line in lines if line["logger"] == "trioshed.requests" and line["route"] == "/api/generate"]
    assert request["status"] == 200 and request["model"] == "tiny:latest" and request["eval_tokens"] == r.json()["eval_count"]
