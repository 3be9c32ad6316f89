"""A stand-in ``llama-server`` that produces tokens as fast as it can: the relay ceiling's upstream.

``python -m bench.standin --port P [any llama-server flags]`` serves what trioshed and a client
need from a runner, with llama-server's own framing (HTTP/1.1, one chunk per event, the event
bodies recorded from b10068 on a tiny model): ``GET /health``, and ``POST /completion``,
``/v1/completions`` and ``/v1/chat/completions``, streamed or whole. A streamed answer of ``n``
tokens (``n_predict`` / ``max_tokens``, default 16) is written event by event without waiting
between them; the kernel hands the relay as many events per read as it has fallen behind.
Written in Python, though, the stand-in is about as slow per event as a Python relay, so with one
event per write the relay rarely falls behind. ``TRIOSHED_STANDIN_BURST=N`` writes N events per
write: the upstream then outruns the relay, which is the only limit (the relay's ceiling).

trioshed runs it as its runner binary (``TRIOSHED_LLAMA_SERVER`` pointing at a small shell
wrapper, see :func:`write_wrapper`); every other flag is accepted and ignored. ``--api-key`` is
honoured as llama-server honours it (401 without ``Authorization: Bearer <key>``), ``/health``
stays open. Nothing is read from the model file.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from functools import partial
from pathlib import Path

import trio

_CREATED = 1796306133
_ID = "chatcmpl-standin0000000000000000000000"
_FP = "b1-571d0d5"
#: Events per write (default 1, as llama-server writes them). Larger: the bytes a relay finds
#: queued when it has fallen that many events behind (TCP keeps no write boundaries), so the
#: upstream outruns any relay and the relay's own cost is the only limit.
BURST_ENV = "TRIOSHED_STANDIN_BURST"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(n: int) -> dict[str, object]:
    return {"completion_tokens": n, "prompt_tokens": 4, "total_tokens": n + 4, "prompt_tokens_details": {"cached_tokens": 0}}


def _timings(n: int) -> dict[str, object]:
    return {"cache_n": 0, "prompt_n": 4, "prompt_ms": 0.5, "prompt_per_token_ms": 0.125, "prompt_per_second": 8000.0,
            "predicted_n": n, "predicted_ms": 1.0, "predicted_per_token_ms": 1.0 / max(n, 1), "predicted_per_second": 1000.0 * n}  # fmt: skip


def events(path: str, body: dict[str, object], model: str) -> list[bytes]:
    """The SSE events llama-server sends for ``body`` on ``path`` (``n`` tokens of `` tok``)."""
    n = int(body.get("n_predict") or body.get("max_tokens") or body.get("max_completion_tokens") or 16)  # type: ignore[call-overload]
    if path == "/completion":
        out = [_sse({"index": 0, "content": " tok", "tokens": [42], "stop": False, "id_slot": -1,
                     "tokens_predicted": i + 1, "tokens_evaluated": 4}) for i in range(n)]  # fmt: skip
        out.append(_sse({"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": model,
                         "tokens_predicted": n, "tokens_evaluated": 4, "stop_type": "limit", "stopping_word": "",
                         "tokens_cached": 4 + n, "timings": _timings(n), "truncated": False}))  # fmt: skip
        return out
    head = {"created": _CREATED, "id": _ID, "model": model, "system_fingerprint": _FP}
    if path == "/v1/completions":
        out = [_sse({"choices": [{"text": " tok", "index": 0, "logprobs": None, "finish_reason": None}], **head, "object": "text_completion"})
               for _ in range(n)]  # fmt: skip
        out.append(_sse({"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], **head,
                         "object": "text_completion", "usage": _usage(n), "timings": _timings(n)}))  # fmt: skip
    else:
        kind = {**head, "object": "chat.completion.chunk"}
        out = [_sse({"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}], **kind})]
        out += [_sse({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " tok"}}], **kind}) for _ in range(n)]
        out.append(_sse({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **kind}))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            out.append(_sse({"choices": [], **kind, "usage": _usage(n), "timings": _timings(n)}))
    out.append(b"data: [DONE]\n\n")
    return out


def whole(path: str, body: dict[str, object], model: str) -> dict[str, object]:
    n = int(body.get("n_predict") or body.get("max_tokens") or 16)  # type: ignore[call-overload]
    text = " tok" * n
    if path == "/completion":
        return {"index": 0, "content": text, "tokens": [], "id_slot": 0, "stop": True, "model": model, "tokens_predicted": n,
                "tokens_evaluated": 4, "stop_type": "limit", "stopping_word": "", "timings": _timings(n), "truncated": False}  # fmt: skip
    head = {"created": _CREATED, "id": _ID, "model": model, "system_fingerprint": _FP, "usage": _usage(n), "timings": _timings(n)}
    if path == "/v1/completions":
        return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}], **head, "object": "text_completion"}
    return {"choices": [{"finish_reason": "length", "index": 0, "message": {"role": "assistant", "content": text}}], **head,
            "object": "chat.completion"}  # fmt: skip


async def _read_request(stream: trio.SocketStream, buf: bytearray) -> tuple[str, str, dict[str, str], bytes] | None:
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        body += data
    buf[:] = body[length:]
    return method, path, headers, bytes(body[:length])


def _answer(status: int, body: bytes, content_type: str = "application/json; charset=utf-8") -> bytes:
    reason = {200: "OK", 401: "Unauthorized", 404: "Not Found"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: {content_type}\r\n"
            f"Server: llama.cpp\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


async def _serve_connection(
    model: str, api_key: str | None, burst: int, stream: trio.SocketStream
) -> None:
    buf = bytearray()
    async with stream:
        while (request := await _read_request(stream, buf)) is not None:
            method, path, headers, raw = request
            path = path.split("?", 1)[0]
            if path == "/health":
                await stream.send_all(_answer(200, b'{"status":"ok"}'))
                continue
            if api_key and headers.get("authorization") != f"Bearer {api_key}":
                await stream.send_all(_answer(401, b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'))
                continue
            if method != "POST" or path not in ("/completion", "/v1/completions", "/v1/chat/completions"):
                await stream.send_all(_answer(404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'))
                continue
            body = json.loads(raw or b"{}")
            if not body.get("stream"):
                await stream.send_all(_answer(200, json.dumps(whole(path, body, model)).encode()))
                continue
            await stream.send_all(b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n"
                                  b"X-Accel-Buffering: no\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\n\r\n")  # fmt: skip
            framed = [_chunk(event) for event in events(path, body, model)]
            if burst <= 1:
                for chunk in framed:
                    await stream.send_all(chunk)  # one write per event, as llama-server does
                await stream.send_all(b"0\r\n\r\n")
            else:  # what a reader that fell ``burst`` events behind finds queued in the socket
                framed.append(b"0\r\n\r\n")
                for i in range(0, len(framed), burst):
                    await stream.send_all(b"".join(framed[i : i + burst]))
            return  # llama-server closes a connection after a streamed answer


def _arg(argv: list[str], *names: str) -> str | None:
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return argv[i + 1]
    return None


async def main(argv: list[str]) -> None:
    if "--version" in argv:
        print("version: 1 (standin)\nbuilt with the relay bench's stand-in", file=sys.stderr)
        return
    if "--list-devices" in argv:
        print("Available devices:", file=sys.stderr)
        return
    port = int(_arg(argv, "--port") or 8080)
    model = _arg(argv, "--alias") or _arg(argv, "--model", "-m") or "standin"
    api_key = _arg(argv, "--api-key")
    print(f"standin: listening on 127.0.0.1:{port} for {model}", file=sys.stderr, flush=True)
    burst = int(os.environ.get(BURST_ENV, "1"))
    await trio.serve_tcp(partial(_serve_connection, model, api_key, burst), port, host="127.0.0.1")


def write_wrapper(folder: Path) -> Path:
    """A ``llama-server``-like executable running this stand-in with this Python."""
    path = folder / "standin-llama-server"
    root = Path(__file__).resolve().parent.parent
    path.write_text(f'#!/bin/sh\ncd {root} && exec {sys.executable} -m bench.standin "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


if __name__ == "__main__":
    try:
        trio.run(main, sys.argv[1:])
    except KeyboardInterrupt:
        os._exit(0)
