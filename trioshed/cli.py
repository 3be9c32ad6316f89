"""``trioshed serve | pull | create | push | cp | run | ps | list | show | stop``.

``serve`` runs the server; the others are small clients of a running one (``TRIOSHED_HOST``).
``pull`` without a running server pulls into the store itself (the same code the server runs).
``create`` reads a Modelfile here and uploads its local files as blobs, so it works against a
server on another machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx

from trioshed import __version__
from trioshed.cli_progress import PullView
from trioshed.config import Settings


def unusable_store(folder: Path) -> str | None:
    """Why ``folder`` cannot be a model store (``None``: it can; it is created if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it is a file, not a folder; set TRIOSHED_MODELS to a folder"
    except OSError as exc:
        return f"cannot create it ({exc.strerror or type(exc).__name__}); set TRIOSHED_MODELS to a folder trioshed may create"
    if not folder.is_dir():
        return "it is not a folder; set TRIOSHED_MODELS to a folder"
    if not os.access(folder, os.R_OK | os.X_OK):
        return "cannot read it (permission denied)"
    return None


def _say(line: str) -> None:
    """A line on stderr for the operator: never fatal (a full disk, a closed terminal)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _client(settings: Settings) -> httpx.Client:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    if host in ("0.0.0.0", "[::]"):
        host = "127.0.0.1"
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.Client(base_url=f"http://{host}:{settings.port}", timeout=None, headers=headers)


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from trioshed.runner.binary import BinaryNotFound, find_llama_server

    try:
        binary = find_llama_server(settings.llama_server)
    except BinaryNotFound as exc:
        print(f"trioshed: {exc}", file=sys.stderr)
        return 1
    from trioshed.models.ollama_store import is_ollama_store
    from trioshed.models.stores import store_folders

    folders = [f for f in store_folders(settings.models) if not is_ollama_store(f)]
    for folder in folders:
        if problem := unusable_store(folder):
            _say(f"trioshed: TRIOSHED_MODELS: {folder}: {problem}")
            return 2
    assembly = None
    if folders and args.demo_model:
        from trioshed.models.demo import start_demo_assembly

        assembly = start_demo_assembly(folders[0], _say)  # a thread, while the server imports
    import trio

    from trioshed.models.demo import DemoUnavailable
    from trioshed.server import serve

    if assembly is not None:
        try:
            assembly.wait()
        except DemoUnavailable as exc:
            _say(f"trioshed: {exc}")
            return 1
    banner = f"trioshed {__version__}: serving {settings.models} on http://{settings.host}:{settings.port}"
    if settings.log_format == "json":
        logging.getLogger("trioshed").info(banner)  # every line of a JSON log is JSON
    else:
        _say(banner)
    from trioshed.devices.rpc import check_addresses

    try:  # a public RPC server address is refused before anything starts
        trio.run(lambda: check_addresses(settings.rpc_servers, allow_public=settings.rpc_allow_public))
    except ValueError as exc:
        print(f"trioshed: {exc}", file=sys.stderr)
        return 2
    trio.run(lambda: serve(settings, binary=binary))
    return 0


def _cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client, client.stream(
        "POST", "/api/generate", json={"model": args.model, "prompt": " ".join(args.prompt), "stream": True}
    ) as response:
        if response.status_code != 200:
            response.read()
            print(f"error: {response.json().get('error', response.text)}", file=sys.stderr)
            return 1
        for line in response.iter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                print(f"\nerror: {chunk['error']}", file=sys.stderr)
                return 1
            print(chunk.get("response", ""), end="", flush=True)
        print()
    return 0


def _cmd_pull(args: argparse.Namespace, settings: Settings) -> int:
    """``POST /api/pull`` streamed, shown as ``ollama pull`` shows it; without a server, the same
    pull done here into the store."""
    view = PullView(tty=sys.stderr.isatty())
    body = {"model": args.model, "insecure": args.insecure, "stream": True}
    try:
        with _client(settings) as client, client.stream("POST", "/api/pull", json=body) as response:
            if response.status_code != 200:
                response.read()
                print(f"Error: {_error_of(response)}", file=sys.stderr)
                return 1
            for line in response.iter_lines():
                if not line.strip():
                    continue
                chunk = json.loads(line)
                if "error" in chunk:
                    print(f"{view.close()}Error: {chunk['error']}", file=sys.stderr)
                    return 1
                print(view.feed(chunk), end="", file=sys.stderr, flush=True)
    except httpx.ConnectError:
        return _pull_here(args, settings, view)
    print(view.close(), end="", file=sys.stderr)
    return 0


def _error_of(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text


def _pull_here(args: argparse.Namespace, settings: Settings, view: PullView) -> int:
    """No server at TRIOSHED_HOST: pull into the store directly."""
    import trio

    from trioshed.errors import TrioshedError
    from trioshed.models.pull import Puller
    from trioshed.models.stores import Stores

    root = Stores(settings.models).pull_root
    print(f"no server at {settings.host}:{settings.port}: pulling into {root or settings.models} directly", file=sys.stderr)

    async def pull() -> None:
        async for line in Puller(root).pull(args.model, insecure=args.insecure):
            print(view.feed(line), end="", file=sys.stderr, flush=True)

    try:
        trio.run(pull)
    except TrioshedError as exc:
        print(f"{view.close()}Error: {exc.message}", file=sys.stderr)
        return 1
    print(view.close(), end="", file=sys.stderr)
    return 0


def _stream_progress(client: httpx.Client, path: str, body: dict[str, object], view: PullView) -> int:
    """POST ``body`` to a route that streams Ollama's progress lines, shown as a pull is."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            print(f"Error: {_error_of(response)}", file=sys.stderr)
            return 1
        for line in response.iter_lines():
            if not line.strip():
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                print(f"{view.close()}Error: {chunk['error']}", file=sys.stderr)
                return 1
            print(view.feed(chunk), end="", file=sys.stderr, flush=True)
    print(view.close(), end="", file=sys.stderr)
    return 0


def _upload(client: httpx.Client, path: Path, view: PullView) -> str:
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

    def chunks():  # type: ignore[no-untyped-def]
        sent = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sent += len(chunk)
                print(view.feed({"status": status, "digest": digest, "total": total, "completed": sent}), end="", file=sys.stderr, flush=True)
                yield chunk

    response = client.post(f"/api/blobs/{digest}", content=chunks(), headers={"Content-Length": str(total), "Content-Type": "application/octet-stream"})
    if response.status_code not in (200, 201):
        raise _CliError(f"uploading {path.name}: {_error_of(response)}")
    return digest


class _CliError(Exception):
    pass


def _cmd_create(args: argparse.Namespace, settings: Settings) -> int:
    """``ollama create NAME -f Modelfile``: the Modelfile parsed here, ``FROM``/``ADAPTER`` files
    (a GGUF, or a folder of them) uploaded as blobs, then ``/api/create`` with the fields."""
    from trioshed.errors import TrioshedError
    from trioshed.models.modelfile import parse, request_fields

    source = Path(args.file).expanduser()
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"Error: cannot read {source}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    view = PullView(tty=sys.stderr.isatty())
    try:
        fields = request_fields(parse(text))
        with _client(settings) as client:
            files: dict[str, str] = {}
            adapters: dict[str, str] = {}
            froms = [fields.pop("from"), *fields.pop("_more_from", [])]
            for value in froms:
                local = _local_files(source.parent, value)
                if local is None:
                    if "from" in fields or files:
                        raise _CliError(f"FROM {value}: only the first FROM may name a model")
                    fields["from"] = value
                    continue
                print(view.feed({"status": "gathering model components"}), end="", file=sys.stderr)
                for path in local:
                    files[path.name] = _upload(client, path, view)
            for value in fields.pop("_adapters", []):
                local = _local_files(source.parent, value)
                if local is None:
                    raise _CliError(f"ADAPTER {value}: no such file")
                for path in local:
                    adapters[path.name] = _upload(client, path, view)
            if files:
                fields["files"] = files
            if adapters:
                fields["adapters"] = adapters
            return _stream_progress(client, "/api/create", {"model": args.model, **fields}, view)
    except (TrioshedError, _CliError) as exc:
        print(f"{view.close()}Error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1


def _local_files(base: Path, value: str) -> list[Path] | None:
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
            raise _CliError(f"{value}: the folder has no .gguf file (trioshed serves GGUF models; convert with llama.cpp's convert_hf_to_gguf.py)")
        return found
    if path.is_file():
        return [path]
    if re.search(r"sha256-[0-9a-f]{64}$", text):
        return None  # the server's own blob, named as /api/show writes it
    raise _CliError(f"{value}: no such file or folder")


def _cmd_push(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        return _stream_progress(client, "/api/push", {"model": args.model, "insecure": args.insecure}, PullView(tty=sys.stderr.isatty()))


def _cmd_cp(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        response = client.post("/api/copy", json={"source": args.source, "destination": args.destination})
    if response.status_code != 200:
        print(f"Error: {_error_of(response)}", file=sys.stderr)
        return 1
    print(f"copied '{args.source}' to '{args.destination}'", file=sys.stderr)
    return 0


def _cmd_get(path: str, key: str, columns: list[str]):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace, settings: Settings) -> int:
        with _client(settings) as client:
            response = client.get(path)
        rows = response.json().get(key, [])
        print("\t".join(c.upper() for c in columns))
        for row in rows:
            print("\t".join(str(row.get(c, "")) for c in columns))
        return 0

    return run


def _cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        response = client.post("/api/show", json={"model": args.model})
    print(json.dumps(response.json(), indent=2))
    return 0 if response.status_code == 200 else 1


_USAGE_COLUMNS = ("key", "model", "start", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds")


def _cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    """Usage per key, model and day (or hour) from ``GET /api/usage``: a table, or its CSV."""
    params = {k: v for k, v in (("key", args.key), ("model", args.model), ("since", args.since),
                                ("until", args.until), ("by", args.by)) if v}  # fmt: skip
    if args.csv:
        params["format"] = "csv"
    with _client(settings) as client:
        response = client.get("/api/usage", params=params)
    if response.status_code != 200:
        try:
            error = response.json().get("error")
        except ValueError:
            error = response.text[:200]
        print(f"trioshed: {error}", file=sys.stderr)
        return 1
    if args.csv:
        print(response.text, end="")
        return 0
    body = response.json()
    print("\t".join(c.upper() for c in _USAGE_COLUMNS))
    for row in body.get("usage", []):
        print("\t".join(str(row.get(c, "")) for c in _USAGE_COLUMNS))
    budgets = [k for k in body.get("keys", []) if k.get("budgets")]
    if budgets:
        print()
        print("KEY\tBUDGET\tLIMIT\tLEFT")
        for k in budgets:
            for name, b in k["budgets"].items():
                print(f"{k['key']}\t{name}\t{b['limit']}\t{b['left']}")
    return 0


def _cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        response = client.post("/api/generate", json={"model": args.model, "keep_alive": 0})
    print(response.json().get("done_reason") or response.json().get("error"))
    return 0 if response.status_code == 200 else 1


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """Flags, then ``TRIOSHED_*`` variables, then ``--config FILE``, then the defaults."""
    overrides: dict[str, object] = {}
    if getattr(args, "host", None):
        from trioshed.config import parse_host

        overrides["host"], overrides["port"] = parse_host(args.host)
    if getattr(args, "models", None):
        overrides["models"] = Path(args.models).expanduser()
    config = getattr(args, "config", None)
    return Settings.from_env(env, file=Path(config).expanduser() if config else None, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trioshed", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the server")
    p.add_argument("--host", help="listen address host:port (TRIOSHED_HOST)")
    p.add_argument("--models", help="model store folder (TRIOSHED_MODELS)")
    p.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML): keep_alive = \"10m\", max_loaded_models = 2, ... "
             "(flags win over TRIOSHED_* variables, which win over the file)",
    )  # fmt: skip
    p.add_argument("--demo-model", action="store_true", help="assemble Gemma 3 270M into an empty store")
    p.add_argument("-v", "--verbose", action="store_true")
    p = sub.add_parser("pull", help="download a model (llama3.2:1b, user/model:tag, hf.co/USER/REPO:QUANT)")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="skip TLS checks; allow plain HTTP to the name's registry")
    p = sub.add_parser("create", help="create a model from a Modelfile (FROM a GGUF file or folder, a model; PARAMETER, SYSTEM, ...)")
    p.add_argument("model")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p = sub.add_parser("push", help="send a pulled or created model to a registry (host/ns/model:tag)")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="skip TLS checks; allow plain HTTP to the name's registry")
    p = sub.add_parser("cp", help="copy a model to another name")
    p.add_argument("source")
    p.add_argument("destination")
    p = sub.add_parser("run", help="generate from a prompt")
    p.add_argument("model")
    p.add_argument("prompt", nargs="+")
    sub.add_parser("ps", help="list loaded models")
    sub.add_parser("list", help="list models in the store")
    p = sub.add_parser("show", help="model details and memory estimate")
    p.add_argument("model")
    p = sub.add_parser("stop", help="unload a model")
    p.add_argument("model")
    p = sub.add_parser("usage", help="tokens and requests per API key, model and day (TRIOSHED_API_KEY: the key asking)")
    p.add_argument("--key", help="one key's usage (a user key: its own only)")
    p.add_argument("--model", help="one model's usage")
    p.add_argument("--since", help="from this time: YYYY-MM-DD, RFC 3339 or Unix seconds")
    p.add_argument("--until", help="until this time (excluded)")
    p.add_argument("--by", choices=("day", "hour"), default="day")
    p.add_argument("--csv", action="store_true", help="CSV instead of a table")
    args = parser.parse_args(argv)
    serving = args.command == "serve"
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO if serving else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"trioshed: {exc}", file=sys.stderr)
        return 2
    if settings.log_format != "text":
        from trioshed.logs import use_format

        use_format(settings.log_format)
    commands = {
        "serve": _cmd_serve,
        "pull": _cmd_pull,
        "create": _cmd_create,
        "push": _cmd_push,
        "cp": _cmd_cp,
        "run": _cmd_run,
        "ps": _cmd_get("/api/ps", "models", ["name", "size", "size_vram", "expires_at"]),
        "list": _cmd_get("/api/tags", "models", ["name", "size", "modified_at"]),
        "show": _cmd_show,
        "stop": _cmd_stop,
        "usage": _cmd_usage,
    }
    try:
        return commands[args.command](args, settings)
    except httpx.ConnectError:
        print(f"trioshed: no server at {settings.host}:{settings.port}; start one with `trioshed serve`", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"\ntrioshed: connection to the server failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `trioshed run ... | head`: the reader went away
        sys.stderr.close()
        return 0
