"""Bad input over every route that takes a body: always a JSON 4xx, never a 5xx or a traceback,
and nothing loaded or evicted by it (one server, one loaded runner watched throughout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.server import Server
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

ROUTES = {
    "/api/generate": {"prompt": "hi"},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}]},
    "/api/show": {},
    "/api/embed": {"input": "hi"},
    "/api/embeddings": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/embeddings": {"input": "hi"},
}
LOADS = ("/api/generate", "/api/chat", "/v1/chat/completions", "/v1/completions")  # take options

BAD_NAMES = ["../tiny", "a/b", "a\\b", "tiny\x00", "x" * 1_000_000, "", " ", "..", ":latest", "tiny:../x"]
BAD_VALUES: list[tuple[str, Any]] = [  # (field, value) merged into a valid body
    ("model", 123), ("model", ["tiny"]), ("model", {"name": "tiny"}), ("model", None), ("model", True),
    ("keep_alive", "soon"), ("keep_alive", [1]), ("keep_alive", {}), ("keep_alive", True), ("keep_alive", "5 minutes"),
    ("keep_alive", "1h-"), ("keep_alive", "NaN"),
    ("options", "fast"), ("options", [1]), ("options", 5),
    ("options", {"num_ctx": 0}), ("options", {"num_ctx": 10**9}), ("options", {"num_ctx": -1}),
    ("options", {"num_ctx": "big"}), ("options", {"num_predict": -5}), ("options", {"num_gpu": 10**6}),
    ("options", {"num_batch": 0}), ("options", {"num_batch": 1}), ("options", {"num_thread": -3}), ("options", {"main_gpu": -2}),
    ("options", {"temperature": "hot"}), ("options", {"use_mmap": "perhaps"}), ("options", {"num_ctx": "2.5x"}),
]  # fmt: skip
KIND_VALUES: dict[str, list[tuple[str, Any]]] = {
    "/api/generate": [("prompt", 5), ("prompt", ["a"]), ("images", "x"), ("stream", "yes"), ("system", 3), ("raw", "no"),
                      ("format", 5), ("context", "abc"), ("suffix", 1), ("template", [])],
    "/api/chat": [("messages", "hi"), ("messages", [1]), ("messages", [{"role": 5, "content": "x"}]),
                  ("messages", [{"role": "user", "content": 5}]), ("messages", [{"role": "user", "images": "x"}]),
                  ("tools", "x"), ("stream", "yes"), ("format", 5)],
    "/api/embed": [("input", 5), ("input", [1, 2]), ("input", [["a"]]), ("truncate", "x"), ("dimensions", "x")],
    "/api/embeddings": [("prompt", 5), ("prompt", ["a"])],
    "/v1/chat/completions": [("messages", "hi"), ("messages", [1]), ("max_tokens", "many"), ("stream", "yes"),
                             ("temperature", "hot"), ("n", "x")],
    "/v1/completions": [("prompt", {}), ("max_tokens", "many"), ("stream", "yes")],
    "/v1/embeddings": [("input", 5), ("input", {}), ("input", [[]])],
}  # fmt: skip


def cases() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(label, route, body, headers)."""
    out: list[tuple[str, str, bytes, dict[str, str]]] = []
    js = {"Content-Type": "application/json"}
    for route, extra in ROUTES.items():
        good = {"model": "tiny", **extra}
        for raw in (b"", b"{", b'{"model": "tiny",}', b"\xff\xfe", b"null", b"[]", b'"tiny"', b"5", b"true",
                    b'{"model": "tiny"}' + b"x", b"[" * 100_000,
                    b'{"model": "tiny", "prompt": "\\ud800", "input": "\\udfff", "messages": [{"role": "user", "content": "\\udaac"}]}'):  # fmt: skip
            out.append((f"{route} body {raw[:20]!r}", route, raw, js))
        for name in BAD_NAMES:
            out.append((f"{route} model {name[:20]!r}", route, json.dumps({**good, "model": name}).encode(), js))
        values = BAD_VALUES if route in LOADS else [v for v in BAD_VALUES if v[0] != "options" or route == "/api/embed"]
        if route == "/api/show":  # takes neither keep_alive nor options
            values = [v for v in values if v[0] == "model"]
        for key, value in [*values, *KIND_VALUES.get(route, [])]:
            out.append((f"{route} {key}={value!r}"[:120], route, json.dumps({**good, key: value}).encode(), js))
        for ctype in ("multipart/form-data; boundary=x", "application/xml", "image/png"):
            out.append((f"{route} content-type {ctype}", route, json.dumps(good).encode(), {"Content-Type": ctype}))
    return out


def runner_fingerprint(server: Server) -> list[tuple[int | None, str]]:
    return [(r.pid, r.model) for r in server.scheduler.statistics().runners]


async def test_bad_input_table_is_always_a_json_4xx_and_touches_no_runner(model_store: Path) -> None:
    failures = []
    with trio.fail_after(240):
        async with open_test_server(model_store, max_body=1 << 20) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200
            before, stats = runner_fingerprint(server), server.scheduler.statistics()
            table = cases()
            for label, route, body, headers in table:
                r = await http.post(route, content=body, headers=headers)
                ok = 400 <= r.status_code < 500 and r.headers.get("content-type", "").startswith("application/json")
                try:
                    error = r.json().get("error")
                    ok = ok and bool(error) and "Traceback" not in str(error)
                except (ValueError, AttributeError):
                    ok = False
                if not ok:
                    failures.append(f"{label}: {r.status_code} {r.text[:200]!r}")
            after = server.scheduler.statistics()
            assert not failures, "\n".join(failures)
            assert runner_fingerprint(server) == before
            assert (after.loads, after.unloads, after.leased, after.queued) == (stats.loads, stats.unloads, 0, 0)
            assert len(table) > 350


async def send_raw(port: int, data: bytes) -> bytes:
    """Write ``data`` while reading the answer until the server closes the connection (the
    server may answer and close before all of ``data`` was sent: that write fails, quietly)."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    answer = bytearray()

    async def write() -> None:
        try:
            await sock.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with sock, trio.open_nursery() as nursery:
        nursery.start_soon(write)
        try:
            while chunk := await sock.receive_some(65536):
                answer += chunk
        except trio.BrokenResourceError:
            pass
        nursery.cancel_scope.cancel()
    return bytes(answer)


# The client sends a little more than the server needs to decide: hypercorn closes at once after
# a 413 (no lingering close), and a client still pushing megabytes then may see a reset before it
# reads the answer.
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_50_mb_body_is_413_with_connection_close(model_store: Path, chunked: bool) -> None:
    with trio.fail_after(60):
        # chunked: the limit lowered to 1 MiB, so that the body the server must read stays small
        async with open_test_server(model_store, **({"max_body": 1 << 20} if chunked else {})) as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            size = 50 * 1000 * 1000
            head = b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            piece = b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20)
            if chunked:  # the first 2 MiB of 50 MB, in 1 MiB chunks
                body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(server.settings.max_body // len(piece) + 1))
                request = head + b"Transfer-Encoding: chunked\r\n\r\n" + body
            else:  # 50 MB announced, the first MiB sent
                request = head + b"Content-Length: %d\r\n\r\n" % size + piece
            answer = await send_raw(port, request)
            status, _, rest = answer.partition(b"\r\n")
            headers, _, body_out = rest.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 413"), answer[:300]
            assert b"connection: close" in headers.lower()
            assert "exceeds" in json.loads(body_out)["error"]
            assert server.scheduler.statistics().runners == ()
