"""Loopback stand-ins for an Ollama registry and for Hugging Face, for the pull tests.

One small HTTP/1.1 server (one request per connection) speaks both protocols as far as a pull
uses them:

* the Ollama registry: ``GET /v2/<ns>/<model>/manifests/<tag>`` (404 with the registry's error
  body for an unknown name) and ``GET /v2/<ns>/<model>/blobs/<digest>``, which redirects (307) to
  ``/cdn/<digest>`` as the real registry redirects to its CDN;
* Hugging Face: ``GET /api/models/<user>/<repo>/tree/main`` (the file list with each file's LFS
  sha256 and size) and ``GET /<user>/<repo>/resolve/main/<path>``, which redirects (302) to the
  same ``/cdn/`` path.

``/cdn/<digest>`` serves the bytes with ``Range: bytes=N-`` support (206 and ``Content-Range``).
Faults for the tests: ``cut[digest] = n`` sends the full ``Content-Length`` but closes after
``n`` bytes of the body (once, or on every request with ``cut_always``); ``tamper`` serves other
bytes of the same size; ``pad`` serves 1 KiB more than the blob; ``no_range`` ignores ``Range``;
``gate[digest]`` sends half the blob, sets ``paused[digest]`` and waits for the gate before the
rest; ``token`` requires ``Authorization: Bearer <token>`` on ``/v2/`` and answers 401 with a
bearer challenge whose realm (``/token``) grants it. Every request is recorded in ``requests``.

Pushes, checked as a registry checks them: ``HEAD /v2/<ns>/<model>/blobs/<digest>`` (200 or
404), ``POST …/blobs/uploads/`` (202, ``Location: /upload/<n>``), ``PATCH /upload/<n>`` with a
``Content-Range`` that must continue the upload, ``PUT /upload/<n>?digest=…`` (the bytes' sha256
must be the digest: else 400 ``DIGEST_INVALID``) and ``PUT …/manifests/<tag>`` (the manifest
type, and every blob it names already received: else 400 ``BLOB_UNKNOWN``). ``problems`` lists
every refusal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import trio

from trioshed.models import ollama_store as o
from trioshed.models.pull_plan import CONFIG_V1, MANIFEST_V2


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class StandIn:
    manifests: dict[tuple[str, str, str], bytes] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)  # "sha256:<hex>" → bytes
    hf: dict[tuple[str, str], dict[str, bytes]] = field(default_factory=dict)
    cut: dict[str, int] = field(default_factory=dict)
    cut_always: bool = False
    tamper: set[str] = field(default_factory=set)
    pad: set[str] = field(default_factory=set)  # these blobs are served with 1 KiB more than they are
    no_range: bool = False  # answer 200 with the whole blob whatever the Range header says
    gate: dict[str, trio.Event] = field(default_factory=dict)
    paused: dict[str, trio.Event] = field(default_factory=dict)
    token: str | None = None
    requests: list[Seen] = field(default_factory=list)
    base_url: str = ""
    uploads: dict[str, bytearray] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    # -- content -------------------------------------------------------------------------------

    def add_blob(self, data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    def add_ollama_model(
        self, name: str, gguf: bytes, *, template: str | None = None, params: dict[str, Any] | None = None,
        system: str | None = None, projector: bytes | None = None, adapters: tuple[bytes, ...] = (),
    ) -> bytes:  # fmt: skip
        """A model in Ollama's registry layout; returns its manifest's bytes."""
        parsed = o.parse_name(name)
        layers = [{"mediaType": o.MEDIA_MODEL, **self.add_blob(gguf)}]
        layers += [{"mediaType": o.MEDIA_ADAPTER, **self.add_blob(a)} for a in adapters]
        if projector is not None:
            layers.append({"mediaType": o.MEDIA_PROJECTOR, **self.add_blob(projector)})
        if template is not None:
            layers.append({"mediaType": o.MEDIA_TEMPLATE, **self.add_blob(template.encode())})
        if system is not None:
            layers.append({"mediaType": o.MEDIA_SYSTEM, **self.add_blob(system.encode())})
        if params is not None:
            layers.append({"mediaType": o.MEDIA_PARAMS, **self.add_blob(json.dumps(params).encode())})
        config = json.dumps({"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
                             "model_type": "1M", "file_type": "F32"}).encode()  # fmt: skip
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_V2,
            "config": {"mediaType": CONFIG_V1, **self.add_blob(config)}, "layers": layers,
        }).encode()  # fmt: skip
        self.manifests[(parsed.namespace, parsed.model, parsed.tag)] = manifest
        return manifest

    def add_hf_repo(self, repo: str, files: dict[str, bytes]) -> None:
        user, name = repo.split("/")
        self.hf[(user, name)] = dict(files)
        for data in files.values():
            self.add_blob(data)

    def blob_requests(self, digest: str) -> list[Seen]:
        return [r for r in self.requests if r.path == f"/cdn/{digest}"]

    # -- serving -------------------------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve_one(stream)
        except trio.BrokenResourceError:
            pass  # the client left mid-answer (a cancelled pull), as clients of a registry do

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk or len(data) > 65536 or not (data + chunk)[:1].isalpha():
                    return  # closed, too long, or not HTTP (a TLS handshake): close at once
                data += chunk
            raw_head, _, body = data.partition(b"\r\n\r\n")
            head = raw_head.decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
            path = unquote(urlsplit(target).path)
            self.requests.append(Seen(method, path, headers))
            if method in ("PUT", "PATCH", "POST"):
                length = int(headers.get("content-length") or 0)
                while len(body) < length:
                    chunk = await stream.receive_some(1 << 20)
                    if not chunk:
                        return
                    body += chunk
                if await self._push(stream, method, path, dict(parse_qsl(urlsplit(target).query)), headers, bytes(body)):
                    return
            await self._route(stream, method, path, headers)

    async def _push(self, stream: trio.SocketStream, method: str, path: str, query: dict[str, str], headers: dict[str, str],
                    body: bytes) -> bool:  # fmt: skip
        """The push side; False for a request that is not one."""
        parts = path.strip("/").split("/")
        if parts[0] == "v2" and self.token and headers.get("authorization") != f"Bearer {self.token}":
            return False  # _route answers the 401
        if method == "POST" and len(parts) == 5 and parts[0] == "v2" and parts[3:] == ["blobs", "uploads"]:
            upload = str(len(self.uploads))
            self.uploads[upload] = bytearray()
            await self._send(stream, "202 Accepted", b"", {"Location": f"/upload/{upload}", "Range": "0-0"})
            return True
        if len(parts) == 2 and parts[0] == "upload" and parts[1] in self.uploads:
            data = self.uploads[parts[1]]
            if method == "PATCH":
                start = (headers.get("content-range") or "").partition("-")[0]
                if not start.isdigit() or int(start) != len(data):
                    self.problems.append(f"PATCH at {start!r}, the upload has {len(data)} bytes")
                    await self._send(stream, "416 Range Not Satisfiable", b'{"errors":[{"code":"BLOB_UPLOAD_INVALID"}]}')
                    return True
                data += body
                await self._send(stream, "202 Accepted", b"", {"Location": f"/upload/{parts[1]}", "Range": f"0-{len(data) - 1}"})
                return True
            if method == "PUT":
                data += body
                digest = query.get("digest", "")
                if digest != "sha256:" + hashlib.sha256(data).hexdigest():
                    self.problems.append(f"upload {parts[1]}: its bytes are not {digest}")
                    await self._send(stream, "400 Bad Request", b'{"errors":[{"code":"DIGEST_INVALID"}]}')
                    return True
                self.blobs[digest] = bytes(data)
                del self.uploads[parts[1]]
                await self._send(stream, "201 Created", b"", {"Docker-Content-Digest": digest})
                return True
        if method == "PUT" and len(parts) == 5 and parts[0] == "v2" and parts[3] == "manifests":
            try:
                manifest = json.loads(body)
                named = [x["digest"] for x in [*manifest["layers"], manifest["config"]]]
            except (ValueError, KeyError, TypeError):
                named = None
            if headers.get("content-type") != MANIFEST_V2 or named is None:
                self.problems.append(f"manifest {path}: not a {MANIFEST_V2}")
                await self._send(stream, "400 Bad Request", b'{"errors":[{"code":"MANIFEST_INVALID"}]}')
                return True
            missing = [d for d in named if d not in self.blobs]
            if missing:
                self.problems.append(f"manifest {path} names blobs never pushed: {missing}")
                await self._send(stream, "400 Bad Request", b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
                return True
            self.manifests[(parts[1], parts[2], parts[4])] = body
            await self._send(stream, "201 Created", b"")
            return True
        return False

    async def _send(self, stream: trio.SocketStream, status: str, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    async def _send_head(self, stream: trio.SocketStream, status: str, length: int) -> None:
        await stream.send_all(f"HTTP/1.1 {status}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n".encode())

    async def _route(self, stream: trio.SocketStream, method: str, path: str, headers: dict[str, str]) -> None:
        parts = path.strip("/").split("/")
        if path == "/token":
            await self._send(stream, "200 OK", json.dumps({"token": self.token}).encode(), {"Content-Type": "application/json"})
            return
        if parts[0] == "v2" and self.token and headers.get("authorization") != f"Bearer {self.token}":
            challenge = f'Bearer realm="{self.base_url}/token",service="stand-in",scope="repository:{"/".join(parts[1:3])}:pull"'
            await self._send(stream, "401 Unauthorized", b'{"errors":[{"code":"UNAUTHORIZED"}]}', {"WWW-Authenticate": challenge})
            return
        if len(parts) == 5 and parts[0] == "v2" and parts[3] == "manifests":
            manifest = self.manifests.get((parts[1], parts[2], parts[4]))
            if manifest is None:
                await self._send(stream, "404 Not Found", b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}')
            else:
                await self._send(stream, "200 OK", manifest, {"Content-Type": MANIFEST_V2})
            return
        if method == "HEAD" and len(parts) == 5 and parts[0] == "v2" and parts[3] == "blobs":
            if parts[4] in self.blobs:
                await self._send_head(stream, "200 OK", len(self.blobs[parts[4]]))
            else:
                await self._send_head(stream, "404 Not Found", 0)
            return
        if len(parts) == 5 and parts[0] == "v2" and parts[3] == "blobs":
            if parts[4] in self.blobs:
                await self._send(stream, "307 Temporary Redirect", b"", {"Location": f"{self.base_url}/cdn/{parts[4]}"})
            else:
                await self._send(stream, "404 Not Found", b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
            return
        if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            files = self.hf.get((parts[2], parts[3]))
            if files is None:
                await self._send(stream, "401 Unauthorized", b'{"error":"Repository not found"}')  # as Hugging Face answers
                return
            tree = [{"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                     "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                    for p, d in files.items()]  # fmt: skip
            await self._send(stream, "200 OK", json.dumps(tree).encode(), {"Content-Type": "application/json"})
            return
        if len(parts) >= 5 and parts[2:4] == ["resolve", "main"]:
            files = self.hf.get((parts[0], parts[1])) or {}
            data = files.get("/".join(parts[4:]))
            if data is None:
                await self._send(stream, "404 Not Found", b"Entry not found")
            else:
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                await self._send(stream, "302 Found", b"", {"Location": f"{self.base_url}/cdn/{digest}"})
            return
        if len(parts) == 2 and parts[0] == "cdn" and parts[1] in self.blobs:
            await self._blob(stream, parts[1], headers)
            return
        await self._send(stream, "404 Not Found", b"not found")

    async def _blob(self, stream: trio.SocketStream, digest: str, headers: dict[str, str]) -> None:
        data = self.blobs[digest]
        if digest in self.tamper:
            data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
        if digest in self.pad:
            data += b"\0" * 1024
        start = 0
        status = "200 OK"
        extra: dict[str, str] = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        wanted = headers.get("range", "")
        if not self.no_range and wanted.startswith("bytes=") and wanted.endswith("-") and wanted[6:-1].isdigit():
            start = int(wanted[6:-1])
            status = "206 Partial Content"
            extra["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in extra.items())]
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        cut = self.cut.get(digest)
        if cut is not None:
            if not self.cut_always:
                del self.cut[digest]
            await stream.send_all(body[:cut])
            return  # closes the connection mid-body
        if digest in self.gate:
            half = len(body) // 2
            await stream.send_all(body[:half])
            self.paused.setdefault(digest, trio.Event()).set()
            await self.gate[digest].wait()
            body = body[half:]
        await stream.send_all(body)


@asynccontextmanager
async def open_stand_in(stand_in: StandIn | None = None) -> AsyncIterator[StandIn]:
    """Serve ``stand_in`` on 127.0.0.1:<free port> until the block ends."""
    stand_in = stand_in if stand_in is not None else StandIn()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, stand_in._handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        stand_in.base_url = f"http://127.0.0.1:{port}"
        try:
            yield stand_in
        finally:
            nursery.cancel_scope.cancel(reason="stand-in closed")


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: a store's state, to compare before and after."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}
