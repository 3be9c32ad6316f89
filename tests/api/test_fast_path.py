"""The generating routes served as plain ASGI (``trioshed.api.pipeline.fast_path``) answer exactly as
the Quart routes do: the same statuses, headers and bodies, errors in each protocol's shape, the
same gate (origin, key, rate, size), and a connection closed when the client asked for it.

A real ``trioshed serve`` over the relay bench's stand-in llama-server (no model to load), once
with the fast routes (the default) and once with ``TRIOSHED_FAST_ROUTES=0``.

Both paths call one request wrapper (``trioshed.api.pipeline.wrapper``: trace, gate, errors, CORS), so
the equality holds by construction; this comparison stays as evidence of it, end to end.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import trio
from quart import Response

from bench import procs
from bench.relay import one_request
from bench.standin import write_wrapper
from trioshed.api.pipeline.fast_path import FastPath, _next_message, _taker
from trioshed.api.pipeline.upstream import Last
from trioshed.api.pipeline.wrapper import Entry
from trioshed.testing.tiny import write_tiny_model

KEYS = """
[[key]]
name = "alice"
key = "alice-secret-1"
requests_per_minute = 2

[[key]]
name = "bob"
key = "bob-secret-22"
"""

#: (path, streamed body, whole body): each generating route
ROUTES = {
    "/api/generate": {"model": "tiny", "prompt": "hi", "raw": True, "options": {"num_predict": 3}},
    "/api/chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 3},
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
}
#: what varies between two answers to the same request: times, durations, ids
_VARYING = re.compile(rb'("(?:[a-z_]*id|created(?:_at)?|completed_at|[a-z_]*duration)": ?)("[^"]*"|[0-9.]+)')


@asynccontextmanager
async def _server(tmp_path: Path, *, fast: bool, keys: bool = False, max_body: int | None = None) -> AsyncIterator[procs.Server]:
    base = tmp_path / ("fast" if fast else "quart")
    models = base / "models"
    models.mkdir(parents=True)
    write_tiny_model(models / "tiny.gguf")
    env = {"TRIOSHED_LLAMA_SERVER": str(write_wrapper(base)), "TRIOSHED_FAST_ROUTES": "1" if fast else "0"}
    if keys:
        (base / "keys.toml").write_text(KEYS)
        env["TRIOSHED_KEYS_FILE"] = str(base / "keys.toml")
    if max_body is not None:
        env["TRIOSHED_MAX_BODY"] = str(max_body)
    flags = procs.RunnerFlags(parallel=4, ctx_per_slot=64)
    ready = "/ui" if keys else "/api/version"  # /ui answers without a key
    async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=env, ready_path=ready) as server:
        yield server


def _normal(body: bytes) -> bytes:
    return _VARYING.sub(rb"\1_", body)


async def _answers(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, bool], tuple[object, ...]]:
    out: dict[tuple[str, bool], tuple[object, ...]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        for path, body in ROUTES.items():
            for stream in (True, False):
                r = await client.post(path, json={**body, "stream": stream})
                out[(path, stream)] = (r.status_code, r.headers.get("content-type", ""), _normal(r.content))
        for path in ROUTES:  # errors: bad JSON, an unknown model, a wrong type
            r1 = await client.post(path, content=b"{nope", headers={"content-type": "application/json"})
            r2 = await client.post(path, json={**ROUTES[path], "model": "missing-model"})
            r3 = await client.post(path, json={**ROUTES[path], "stream": "yes", "messages": 3, "prompt": 3})
            out[(path + " errors", False)] = (r1.status_code, r2.status_code, r3.status_code, r1.content + r2.content + r3.content)
    return out


async def test_the_fast_routes_answer_exactly_as_the_quart_routes(tmp_path: Path) -> None:
    with trio.fail_after(180):
        async with _server(tmp_path, fast=True) as fast:
            got = await _answers(fast.base_url, {"Origin": "http://localhost:3000"})
        async with _server(tmp_path, fast=False) as slow:
            want = await _answers(slow.base_url, {"Origin": "http://localhost:3000"})
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key
    # and they were real answers: every streamed route relayed the stand-in's three tokens
    for path in ROUTES:
        status, _, body = got[(path, True)]
        assert status == 200 and isinstance(body, bytes) and body.count(b"tok") >= 3, (path, body)


async def test_cors_and_the_origin_check_hold_on_the_fast_routes(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with _server(tmp_path, fast=True) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            body = {**ROUTES["/v1/chat/completions"], "stream": True}
            ok = await client.post("/v1/chat/completions", json=body, headers={"Origin": "http://localhost:5173"})
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == "http://localhost:5173"
            assert ok.headers["vary"] == "Origin"
            evil = await client.post("/v1/chat/completions", json=body, headers={"Origin": "http://localhost.evil.example"})
            assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
            assert "origin" in evil.json()["error"]["message"]
            rebound = await client.post("/api/generate", json=ROUTES["/api/generate"], headers={"Host": "attacker.example"})
            assert rebound.status_code == 403
            # an error answered by the fast route itself carries CORS headers too
            missing = await client.post("/api/chat", json={**ROUTES["/api/chat"], "model": "nope"},
                                        headers={"Origin": "http://localhost:5173"})  # fmt: skip
            assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == "http://localhost:5173"
            wrong_type = await client.post("/api/chat", content=b"{}", headers={"Content-Type": "application/xml"})
            assert wrong_type.status_code == 415


async def test_keys_and_the_rate_are_counted_once_per_request_on_the_fast_routes(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with _server(tmp_path, fast=True, keys=True) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            body = {**ROUTES["/api/generate"], "stream": True}
            assert (await client.post("/api/generate", json=body)).status_code == 401
            wrong = await client.post("/api/generate", json=body, headers={"Authorization": "Bearer alice-secret-2"})
            assert wrong.status_code == 401
            alice = {"x-api-key": "alice-secret-1"}
            first = await client.post("/api/generate", json=body, headers=alice)
            second = await client.post("/v1/chat/completions", json={**ROUTES["/v1/chat/completions"], "stream": True}, headers=alice)
            third = await client.post("/api/generate", json=body, headers=alice)
            assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
            assert third.json()["error"] and "alice" in third.json()["error"] and third.headers["retry-after"]
            bob = await client.post("/api/generate", json=body, headers={"Authorization": "Bearer bob-secret-22"})
            assert bob.status_code == 200 and b'"done": true' in bob.content


async def test_a_chunked_body_over_the_limit_is_refused_with_413(tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    with trio.fail_after(120):
        async with _server(tmp_path, fast=True, max_body=16384) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            r = await client.post("/api/generate", content=chunks(), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]  # Quart answers it, as before the fast routes
            # under the limit, chunked, is served
            small = await client.post("/api/generate", content=_one(json.dumps({**ROUTES["/api/generate"], "stream": False}).encode()))
            assert small.status_code == 200 and small.json()["done"] is True


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_a_connection_close_request_gets_its_answer_and_the_close(tmp_path: Path) -> None:
    """hypercorn closes such a connection from inside the answer's last send: the fast route must
    not cancel that send when it hears the disconnect (it did, and the connection stayed open)."""
    with trio.fail_after(120):
        async with _server(tmp_path, fast=True) as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            for path in ROUTES:
                body = json.dumps({**ROUTES[path], "stream": True}).encode()
                with trio.fail_after(10):  # the close, not just the answer: the client reads to EOF
                    complete, tokens = await one_request(port, path, body, b"0\r\n\r\n", b"tok")
                assert complete and tokens >= 3, (path, complete, tokens)


class _Wrapper:
    """The request wrapper's part that :meth:`FastPath._answer` calls: admits all, adds no header."""

    def admit(self, entry: Entry, path: str) -> None:
        pass

    def finish(self, headers: object, status: int) -> list[tuple[str, str]]:
        return []


async def _answered(pieces: list[bytes]) -> list[object]:
    """What the fast path sends for a streamed body of ``pieces``, and when the body's clean-up
    (after its last piece) ran among the sends."""
    happened: list[object] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for piece in pieces:
                yield piece
        finally:
            happened.append("clean-up")

    async def handler() -> Response:
        return Response(body(), content_type="text/plain")

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.body":
            happened.append((message["body"], message["more_body"]))
        else:
            happened.append(message["type"])

    state = SimpleNamespace(settings=SimpleNamespace(max_body=1 << 20))
    fast = FastPath(None, state, _Wrapper(), {"/x": handler}, body_timeout=1)  # type: ignore[arg-type]
    async def write(data: bytes) -> None:  # the listener's body writer: as a body message
        happened.append((data, True))

    await fast._answer("POST", "/x", lambda name: None, send, Entry(None), write)
    return happened


async def test_a_streams_last_piece_goes_out_as_its_end_before_the_clean_up() -> None:
    # The client has the whole answer (the chunked terminator with the last piece) before the
    # body gives back its lease and the runner's connection.
    head = "http.response.start"
    assert await _answered([b"a", Last(b"b")]) == [head, (b"a", True), (b"b", False), "clean-up"]
    assert await _answered([b"a", Last()]) == [head, (b"a", True), (b"", False), "clean-up"]
    # without a Last piece, the end follows the clean-up, as before
    assert await _answered([b"a", b"b"]) == [head, (b"a", True), (b"b", True), "clean-up", (b"", False)]


async def test_a_piece_after_the_last_is_not_sent(caplog: pytest.LogCaptureFixture) -> None:
    assert await _answered([Last(b"a"), b"b"]) == ["http.response.start", (b"a", False), "clean-up"]
    assert "after its last piece" in caplog.text


async def test_a_request_message_already_there_is_taken_without_a_turn_of_the_event_loop() -> None:
    send, receive = trio.open_memory_channel[dict[str, object]](10)
    take = _taker(receive.receive)
    assert take is not None
    body, end = {"type": "http.request", "body": b"{}", "more_body": True}, {"type": "http.request", "body": b""}
    send.send_nowait(body)
    send.send_nowait(end)
    with trio.CancelScope() as cancelled:
        cancelled.cancel()  # any checkpoint would raise Cancelled here
        assert await _next_message(receive.receive, take) == body
        assert await _next_message(receive.receive, take) == end
    assert not cancelled.cancelled_caught
    # Not there yet: waited for, as the channel's receive does.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send.send, end)
        assert await _next_message(receive.receive, take) == end
    # Another receive (not a memory channel's) is awaited as it is.
    async def other() -> dict[str, object]:
        return end

    assert _taker(other) is None and await _next_message(other, None) == end
