"""The commands that change the server's model store: ``pull``, ``create``, ``push``, ``cp``, ``rm``.

``pull``, ``create`` and ``push`` show the server's progress lines as ``ollama`` does
(:class:`~trioshed.cli.progress.PullView`). ``pull`` without a running server pulls into the
store itself (the same code the server runs). ``create`` reads a Modelfile here and uploads its
local files as blobs, so it works against a server on another machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trioshed.cli.client import (
    CommandError,
    check_stream,
    checked,
    error_of,
    is_tty,
    open_client,
    say,
    stream_lines,
)
from trioshed.cli.progress import PullView
from trioshed.config import Settings

if TYPE_CHECKING:
    import httpx


def cmd_pull(args: argparse.Namespace, settings: Settings) -> int:
    """``POST /api/pull`` streamed, shown as ``ollama pull`` shows it; without a server, the same
    pull done here into the store."""
    import httpx

    view = PullView(tty=is_tty(sys.stderr))
    body = {"model": args.model, "insecure": args.insecure}
    try:
        with open_client(settings) as client:
            return stream_progress(client, "/api/pull", body, view)
    except httpx.ConnectError:
        return pull_here(args, settings, view)


def pull_here(args: argparse.Namespace, settings: Settings, view: PullView) -> int:
    """No server at TRIOSHED_HOST: pull into the store directly."""
    import trio

    from trioshed.errors import TrioshedError
    from trioshed.models.pull import Puller
    from trioshed.models.stores import Stores

    root = Stores(settings.models).pull_root
    say(f"no server at {settings.host}:{settings.port}: pulling into {root or settings.models} directly")

    async def show(line: dict[str, Any]) -> None:
        print(view.feed(line), end="", file=sys.stderr, flush=True)

    async def pull() -> None:
        await Puller(root).pull(args.model, show, insecure=args.insecure)

    try:
        trio.run(pull)
    except TrioshedError as exc:
        raise CommandError(exc.message) from None
    finally:
        print(view.close(), end="", file=sys.stderr)
    return 0


def stream_progress(client: httpx.Client, path: str, body: dict[str, object], view: PullView | None = None) -> int:
    """POST ``body`` to a route that streams Ollama's progress lines, shown as a pull is (in
    ``view``; a new one by default)."""
    if view is None:
        view = PullView(tty=is_tty(sys.stderr))
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        check_stream(response)
        try:
            for chunk in stream_lines(response):
                print(view.feed(chunk), end="", file=sys.stderr, flush=True)
        finally:
            print(view.close(), end="", file=sys.stderr)
    return 0


def upload(client: httpx.Client, path: Path, view: PullView) -> str:
    """``path`` as a blob of the server (HEAD first: a blob it has is not sent); its digest."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    if client.head(f"/api/blobs/{digest}").status_code == 200:
        return digest
    total = path.stat().st_size
    status = f"copying file {digest}"

    def chunks() -> Iterator[bytes]:
        sent = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sent += len(chunk)
                print(view.feed({"status": status, "digest": digest, "total": total, "completed": sent}), end="", file=sys.stderr, flush=True)
                yield chunk

    response = client.post(f"/api/blobs/{digest}", content=chunks(), headers={"Content-Length": str(total), "Content-Type": "application/octet-stream"})
    if response.status_code not in (200, 201):
        raise CommandError(f"uploading {path.name}: {error_of(response)}")
    return digest


def cmd_create(args: argparse.Namespace, settings: Settings) -> int:
    """``ollama create NAME -f Modelfile``: the Modelfile parsed here, ``FROM``/``ADAPTER`` files
    (a GGUF, or a folder of them) uploaded as blobs, then ``/api/create`` with the fields."""
    from trioshed.errors import TrioshedError
    from trioshed.models.modelfile import parse, request_fields

    source = Path(args.file).expanduser()
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {source}: {getattr(exc, 'strerror', None) or exc}") from None
    view = PullView(tty=is_tty(sys.stderr))
    try:
        fields = request_fields(parse(text))
        with open_client(settings) as client:
            files: dict[str, str] = {}
            adapters: dict[str, str] = {}
            froms = [fields.pop("from"), *fields.pop("_more_from", [])]
            for value in froms:
                local = local_files(source.parent, value)
                if local is None:
                    if "from" in fields or files:
                        raise CommandError(f"FROM {value}: only the first FROM may name a model")
                    fields["from"] = value
                    continue
                print(view.feed({"status": "gathering model components"}), end="", file=sys.stderr)
                for path in local:
                    files[path.name] = upload(client, path, view)
            for value in fields.pop("_adapters", []):
                local = local_files(source.parent, value)
                if local is None:
                    raise CommandError(f"ADAPTER {value}: no such file")
                for path in local:
                    adapters[path.name] = upload(client, path, view)
            print(view.close(), end="", file=sys.stderr)
            if files:
                fields["files"] = files
            if adapters:
                fields["adapters"] = adapters
            return stream_progress(client, "/api/create", {"model": args.model, **fields})
    except TrioshedError as exc:
        raise CommandError(exc.message) from None
    finally:
        print(view.close(), end="", file=sys.stderr)


def local_files(base: Path, value: str) -> list[Path] | None:
    """The local files a ``FROM``/``ADAPTER`` value names (a file, or a folder's ``*.gguf``);
    None for a model name. A path that does not exist is an error, except a blob path of a
    server on another machine (``…/sha256-<hex>``), which the server understands."""
    text = value.strip()
    looks_like_path = text.startswith((".", "/", "~")) or os.sep in text or text.lower().endswith(".gguf")
    if not looks_like_path:
        return None
    path = (base / Path(text).expanduser()).resolve()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if not found:
            raise CommandError(f"{value}: the folder has no .gguf file (trioshed serves GGUF models; convert with llama.cpp's convert_hf_to_gguf.py)")
        return found
    if path.is_file():
        return [path]
    if re.search(r"sha256-[0-9a-f]{64}$", text):
        return None  # the server's own blob, named as /api/show writes it
    raise CommandError(f"{value}: no such file or folder")


def cmd_push(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        return stream_progress(client, "/api/push", {"model": args.model, "insecure": args.insecure})


def cmd_cp(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        checked(client.post("/api/copy", json={"source": args.source, "destination": args.destination}))
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_rm(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        for model in args.model:
            checked(client.request("DELETE", "/api/delete", json={"model": model}))
            print(f"deleted '{model}'")
    return 0
