"""The ``trioshed`` command, with Ollama's verbs and flags where they mean the same.

``serve`` runs the server; the others are small clients of a running one (``TRIOSHED_HOST``),
printing what ``ollama`` prints (:mod:`trioshed.cli_format`). ``pull`` without a running server
pulls into the store itself (the same code the server runs). Every error is one line,
``Error: ...``, with exit status 1 (2 for a bad command line or setting); never a traceback.
``create`` reads a Modelfile here and uploads its local files as blobs, so it works against a
server on another machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from trioshed import __version__, keys_cli
from trioshed.config import Settings

if TYPE_CHECKING:
    import httpx


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


class CommandError(Exception):
    """A client command failed: the one line to print after ``Error: ``."""


def _client(settings: Settings, timeout: float | None = None) -> httpx.Client:
    import httpx  # here, not at the top: ``--help`` and ``--version`` answer without it

    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    if host in ("0.0.0.0", "[::]"):
        host = "127.0.0.1"
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.Client(base_url=f"http://{host}:{settings.port}", timeout=timeout, headers=headers)


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from trioshed.runner.binary import BinaryNotFound, find_llama_server

    try:
        binary = find_llama_server(settings.llama_server)
    except BinaryNotFound as exc:
        _say(f"Error: {exc}")
        return 1
    from trioshed.models.ollama_store import is_ollama_store
    from trioshed.models.stores import store_folders

    folders = [f for f in store_folders(settings.models) if not is_ollama_store(f)]
    for folder in folders:
        if problem := unusable_store(folder):
            _say(f"Error: TRIOSHED_MODELS: {folder}: {problem}")
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
            _say(f"Error: {exc}")
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
        _say(f"Error: {exc}")
        return 2
    trio.run(lambda: serve(settings, binary=binary))
    _exit_now(0)
    return 0  # pragma: no cover - not reached


def _exit_now(code: int) -> NoReturn:
    """Leave at once once the server has stopped: everything it owned (children, sockets,
    files, the database) was closed inside ``serve()``; tearing the interpreter down (every
    module and object freed, one by one) took 0.4-0.8 s more on 2 busy cores, which every
    SIGTERM and ``systemctl restart`` waited for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _error_of(response: httpx.Response) -> str:
    """The server's error message (Ollama's ``{"error": ...}``), else the status and body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str | dict):
        error = body["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    text = response.text.strip().splitlines()
    return f"the server answered {response.status_code}{': ' + text[0][:200] if text else ''}"


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise CommandError(_error_of(response))
    return response


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _stream_lines(response: httpx.Response) -> Any:
    """The JSON lines of a streamed answer; an ``error`` line raises."""
    for line in response.iter_lines():
        if not line.strip():
            continue
        chunk = json.loads(line)
        if "error" in chunk:
            raise CommandError(str(chunk["error"]))
        yield chunk


def _keep_alive(value: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        return {"keep_alive": int(value)}
    except ValueError:
        return {"keep_alive": value}


def _generation_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "stream": True, **_keep_alive(args.keepalive)}
    if args.format:
        body["format"] = args.format
    if args.think is not None:
        body["think"] = args.think
    return body


class _Answer:
    """Writes a streamed answer: thinking (unless hidden) dimmed on a terminal, then the content;
    the spinner until the first token; the last chunk kept for ``--verbose``."""

    def __init__(self, args: argparse.Namespace) -> None:
        from trioshed.cli_progress import Spinner

        self.hide_thinking = bool(args.hidethinking)
        self.tty = _is_tty(sys.stdout)
        self.spinner = Spinner(enabled=_is_tty(sys.stderr))
        self.thinking = False
        self.last: dict[str, Any] = {}

    def write(self, thinking: str, content: str) -> None:
        if thinking or content:
            self.spinner.stop()
        if thinking and not self.hide_thinking:
            if not self.thinking:
                print("\x1b[2mThinking...\n" if self.tty else "Thinking...\n", end="", flush=True)
                self.thinking = True
            print(thinking, end="", flush=True)
        if content:
            if self.thinking:
                print("\n...done thinking.\n\x1b[0m\n" if self.tty else "\n...done thinking.\n\n", end="")
                self.thinking = False
            print(content, end="", flush=True)

    def finish(self, verbose: bool) -> None:
        self.spinner.stop()
        if self.thinking:
            print("\n...done thinking.\x1b[0m" if self.tty else "\n...done thinking.", end="")
            self.thinking = False
        print(flush=True)
        if verbose:
            from trioshed.cli_format import timings

            print(timings(self.last), end="", file=sys.stderr, flush=True)


def _cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    """``ollama run``: a prompt (arguments, standard input before them) answered once, streamed;
    without one on a terminal, a chat."""
    prompts = list(args.prompt)
    if not _is_tty(sys.stdin):
        prompts.insert(0, sys.stdin.read())
    if not prompts:
        return _chat(args, settings)
    body = {**_generation_body(args), "prompt": " ".join(prompts)}
    answer = _Answer(args)
    answer.spinner.start()
    try:
        with _client(settings) as client, client.stream("POST", "/api/generate", json=body) as response:
            if response.status_code >= 400:
                response.read()
                raise CommandError(_error_of(response))
            for chunk in _stream_lines(response):
                answer.write(str(chunk.get("thinking") or ""), str(chunk.get("response") or ""))
                answer.last = chunk
    finally:
        answer.spinner.stop()
    answer.finish(args.verbose)
    return 0


CHAT_HELP = """Available Commands:
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message.
"""


def _chat(args: argparse.Namespace, settings: Settings, read: Any = None) -> int:
    """``ollama run MODEL`` on a terminal: ``>>>`` prompts, ``/bye`` or end of input to leave."""
    if read is None:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        read = input
    messages: list[dict[str, Any]] = []
    with _client(settings) as client:
        # load the model first (a request without messages), as ollama does, with the spinner
        from trioshed.cli_progress import Spinner

        spinner = Spinner(enabled=_is_tty(sys.stderr))
        spinner.start()
        try:
            _checked(client.post("/api/chat", json={"model": args.model, "messages": [], **_keep_alive(args.keepalive)}))
        finally:
            spinner.stop()
        while True:
            try:
                line = read(">>> ")
            except EOFError:
                print()
                return 0
            if line.startswith('"""'):
                parts = [line[3:]]
                while not parts[-1].rstrip().endswith('"""'):
                    try:
                        parts.append(read("... "))
                    except EOFError:
                        print()
                        return 0
                line = "\n".join(parts).rstrip()[:-3]
            text = line.strip()
            if not text:
                continue
            if text in ("/bye", "/exit"):
                return 0
            if text == "/clear":
                messages.clear()
                print("Cleared session context")
                continue
            if text in ("/?", "/help"):
                print(CHAT_HELP, end="")
                continue
            if text.startswith("/"):
                print(f"Unknown command '{text.split()[0]}'. Type /? for help")
                continue
            messages.append({"role": "user", "content": line})
            body = {**_generation_body(args), "messages": messages}
            answer = _Answer(args)
            reply = []
            with client.stream("POST", "/api/chat", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise CommandError(_error_of(response))
                for chunk in _stream_lines(response):
                    message = chunk.get("message") or {}
                    content = str(message.get("content") or "")
                    answer.write(str(message.get("thinking") or ""), content)
                    reply.append(content)
                    answer.last = chunk
            answer.finish(args.verbose)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def _cmd_pull(args: argparse.Namespace, settings: Settings) -> int:
    """``POST /api/pull`` streamed, shown as ``ollama pull`` shows it; without a server, the same
    pull done here into the store."""
    import httpx

    from trioshed.cli_progress import PullView

    view = PullView(tty=_is_tty(sys.stderr))
    body = {"model": args.model, "insecure": args.insecure}
    try:
        with _client(settings) as client:
            return _stream_progress(client, "/api/pull", body, view)
    except httpx.ConnectError:
        return _pull_here(args, settings, view)


def _pull_here(args: argparse.Namespace, settings: Settings, view: Any) -> int:
    """No server at TRIOSHED_HOST: pull into the store directly."""
    import trio

    from trioshed.errors import TrioshedError
    from trioshed.models.pull import Puller
    from trioshed.models.stores import Stores

    root = Stores(settings.models).pull_root
    _say(f"no server at {settings.host}:{settings.port}: pulling into {root or settings.models} directly")

    async def pull() -> None:
        async for line in Puller(root).pull(args.model, insecure=args.insecure):
            print(view.feed(line), end="", file=sys.stderr, flush=True)

    try:
        trio.run(pull)
    except TrioshedError as exc:
        raise CommandError(exc.message) from None
    finally:
        print(view.close(), end="", file=sys.stderr)
    return 0


def _stream_progress(client: httpx.Client, path: str, body: dict[str, object], view: Any = None) -> int:
    """POST ``body`` to a route that streams Ollama's progress lines, shown as a pull is (in
    ``view``, a :class:`~trioshed.cli_progress.PullView`; a new one by default)."""
    from trioshed.cli_progress import PullView

    if view is None:
        view = PullView(tty=_is_tty(sys.stderr))
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code >= 400:
            response.read()
            raise CommandError(_error_of(response))
        try:
            for chunk in _stream_lines(response):
                print(view.feed(chunk), end="", file=sys.stderr, flush=True)
        finally:
            print(view.close(), end="", file=sys.stderr)
    return 0


def _upload(client: httpx.Client, path: Path, view: Any) -> str:
    """``path`` as a blob of the server (HEAD first: a blob it has is not sent); its digest."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    if client.head(f"/api/blobs/{digest}").status_code == 200:
        return digest
    total = path.stat().st_size
    status = f"copying file {digest}"

    def chunks() -> Any:
        sent = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sent += len(chunk)
                print(view.feed({"status": status, "digest": digest, "total": total, "completed": sent}), end="", file=sys.stderr, flush=True)
                yield chunk

    response = client.post(f"/api/blobs/{digest}", content=chunks(), headers={"Content-Length": str(total), "Content-Type": "application/octet-stream"})
    if response.status_code not in (200, 201):
        raise CommandError(f"uploading {path.name}: {_error_of(response)}")
    return digest


def _cmd_create(args: argparse.Namespace, settings: Settings) -> int:
    """``ollama create NAME -f Modelfile``: the Modelfile parsed here, ``FROM``/``ADAPTER`` files
    (a GGUF, or a folder of them) uploaded as blobs, then ``/api/create`` with the fields."""
    from trioshed.cli_progress import PullView
    from trioshed.errors import TrioshedError
    from trioshed.models.modelfile import parse, request_fields

    source = Path(args.file).expanduser()
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {source}: {getattr(exc, 'strerror', None) or exc}") from None
    view = PullView(tty=_is_tty(sys.stderr))
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
                        raise CommandError(f"FROM {value}: only the first FROM may name a model")
                    fields["from"] = value
                    continue
                print(view.feed({"status": "gathering model components"}), end="", file=sys.stderr)
                for path in local:
                    files[path.name] = _upload(client, path, view)
            for value in fields.pop("_adapters", []):
                local = _local_files(source.parent, value)
                if local is None:
                    raise CommandError(f"ADAPTER {value}: no such file")
                for path in local:
                    adapters[path.name] = _upload(client, path, view)
            print(view.close(), end="", file=sys.stderr)
            if files:
                fields["files"] = files
            if adapters:
                fields["adapters"] = adapters
            return _stream_progress(client, "/api/create", {"model": args.model, **fields})
    except TrioshedError as exc:
        raise CommandError(exc.message) from None
    finally:
        print(view.close(), end="", file=sys.stderr)


def _local_files(base: Path, value: str) -> list[Path] | None:
    """The local files a ``FROM``/``ADAPTER`` value names (a file, or a folder's ``*.gguf``);
    None for a model name. A path that does not exist is an error, except a blob path of a
    server on another machine (``…/sha256-<hex>``), which the server understands."""
    import re

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


def _cmd_push(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        return _stream_progress(client, "/api/push", {"model": args.model, "insecure": args.insecure})


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def _cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    from trioshed.cli_format import list_table

    with _client(settings) as client:
        answer = _checked(client.get("/api/tags")).json()
    print(list_table(answer, _now()), end="")
    return 0


def _cmd_ps(args: argparse.Namespace, settings: Settings) -> int:
    from trioshed.cli_format import ps_table

    with _client(settings) as client:
        answer = _checked(client.get("/api/ps")).json()
    print(ps_table(answer, _now()), end="")
    return 0


#: What ``show --FIELD`` prints when the model has none (Ollama's words).
SHOW_NONE = {
    "license": "No license was specified for this model.",
    "modelfile": "No Modelfile was specified for this model.",
    "parameters": "No parameters were specified for this model.",
    "system": "No system message was specified for this model.",
    "template": "No prompt template was specified for this model.",
}


def _cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    from trioshed.cli_format import show_text

    fields = [f for f in SHOW_NONE if getattr(args, f)]
    if len(fields) > 1:
        raise CommandError("only one of --license, --modelfile, --parameters, --system or --template may be given")
    with _client(settings) as client:
        answer = _checked(client.post("/api/show", json={"model": args.model})).json()
    if fields:
        text = str(answer.get(fields[0]) or "")
        print(text.rstrip("\n") if text else SHOW_NONE[fields[0]])
        return 0
    print(show_text(answer, verbose=args.verbose), end="")
    return 0


def _loaded(client: httpx.Client, model: str) -> bool:
    names = {model, model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"}
    return any(m.get("name") in names or m.get("model") in names for m in _checked(client.get("/api/ps")).json().get("models") or [])


def _cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        if not _loaded(client, args.model):
            raise CommandError(f'couldn\'t find model "{args.model}" to stop')
        _checked(client.post("/api/generate", json={"model": args.model, "keep_alive": 0}))
    return 0


def _cmd_cp(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        _checked(client.post("/api/copy", json={"source": args.source, "destination": args.destination}))
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def _cmd_rm(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        for model in args.model:
            _checked(client.request("DELETE", "/api/delete", json={"model": model}))
            print(f"deleted '{model}'")
    return 0


_USAGE_COLUMNS = ("key", "model", "start", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds")


def _cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    """Usage per key, model and day (or hour) from ``GET /api/usage``: a table, or its CSV."""
    params = {k: v for k, v in (("key", args.key), ("model", args.model), ("since", args.since),
                                ("until", args.until), ("by", args.by)) if v}  # fmt: skip
    if args.csv:
        params["format"] = "csv"
    with _client(settings) as client:
        response = _checked(client.get("/api/usage", params=params))
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


def _version_line(settings: Settings) -> str:
    """``ollama -v``: this client's version, and the server's where one answers and differs."""
    import httpx

    line = f"trioshed version is {__version__}"
    try:
        with _client(settings, timeout=2.0) as client:
            server = client.get("/api/version").json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return line
    if server and server != __version__:
        line += f"\nWarning: the server at {settings.host}:{settings.port} is version {server}"
    return line


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


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, ``Error: ...`` with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"Error: {message} (see `{self.prog} --help`)\n")


CLIENT_EPILOG = """environment:
  TRIOSHED_HOST     the server to ask (default 127.0.0.1:11434)
  TRIOSHED_API_KEY  the bearer key, where the server requires one"""

SERVE_EPILOG = """environment (every setting: docs/settings.md):
  TRIOSHED_HOST               listen address (default 127.0.0.1:11434)
  TRIOSHED_MODELS             model store folder (default ~/.trioshed/models)
  TRIOSHED_KEEP_ALIVE         how long a model stays loaded after its last request (default 5m)
  TRIOSHED_MAX_LOADED_MODELS  most models loaded at once (default 0: 3 per GPU, 3 on CPU)
  TRIOSHED_NUM_PARALLEL       parallel requests per model (default 1)
  TRIOSHED_CONTEXT_LENGTH     default context length (default 0: sized from the request, up to the model's)
  TRIOSHED_API_KEY            require this bearer key
  TRIOSHED_LLAMA_SERVER       the llama-server binary (default: the one make install chose)"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trioshed",
        description="A model-scheduling server for local LLM inference, with Ollama's API and command line.",
        epilog="Run `trioshed COMMAND --help` for a command's flags.",
    )
    parser.add_argument("-v", "--version", action="store_true", help="show the version (and the server's, where it differs)")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=_Parser)
    raw = argparse.RawDescriptionHelpFormatter

    def command(name: str, help: str, *, aliases: tuple[str, ...] = (), epilog: str = CLIENT_EPILOG) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:], aliases=list(aliases),
                              epilog=epilog, formatter_class=raw)  # fmt: skip

    p = command("serve", "start the server", aliases=("start",), epilog=SERVE_EPILOG)
    p.add_argument("--host", help="listen address host:port (TRIOSHED_HOST)")
    p.add_argument("--models", metavar="FOLDER", help="model store folder (TRIOSHED_MODELS)")
    p.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML): keep_alive = \"10m\", max_loaded_models = 2, ... "
             "(flags win over TRIOSHED_* variables, which win over the file)",
    )  # fmt: skip
    p.add_argument("--demo-model", action="store_true", help="put Gemma 3 270M into an empty store (what make serve does)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    p = command("show", "show information for a model")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--license", action="store_true", help="show the license of a model")
    p.add_argument("--modelfile", action="store_true", help="show the Modelfile of a model")
    p.add_argument("--parameters", action="store_true", help="show the parameters of a model")
    p.add_argument("--system", action="store_true", help="show the system message of a model")
    p.add_argument("--template", action="store_true", help="show the template of a model")
    p.add_argument("-v", "--verbose", action="store_true", help="show every metadata entry")

    p = command("run", "run a model: answer a prompt, or chat on a terminal")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="the prompt (standard input, when not a terminal, comes before it)")
    p.add_argument("--format", help='response format: "json" or a JSON schema')
    p.add_argument("--keepalive", metavar="DURATION", help='how long the model stays loaded afterwards ("5m", "1h", 0, -1 for ever)')
    p.add_argument("--verbose", action="store_true", help="show timings for the response")
    p.add_argument("--think", action="store_true", default=None, help="let a thinking model think first")
    p.add_argument("--hidethinking", action="store_true", help="think, but show only the answer")

    p = command("stop", "stop (unload) a running model")
    p.add_argument("model", metavar="MODEL")

    p = command("pull", "pull a model: llama3.2:1b, user/model:tag, hf.co/USER/REPO:QUANT")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--insecure", action="store_true", help="use an insecure registry (no TLS checks; plain HTTP allowed)")

    p = command("create", "create a model from a Modelfile (FROM a GGUF file or folder, or a model; PARAMETER, SYSTEM, ...)")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("-f", "--file", default="Modelfile", help="name of the Modelfile (default: ./Modelfile)")

    p = command("push", "push a model to a registry (host/namespace/model:tag)")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--insecure", action="store_true", help="use an insecure registry (no TLS checks; plain HTTP allowed)")

    command("list", "list models", aliases=("ls",))
    command("ps", "list running models")

    p = command("cp", "copy a model")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("destination", metavar="DESTINATION")

    p = command("rm", "remove a model")
    p.add_argument("model", metavar="MODEL", nargs="+")

    p = command("usage", "tokens and requests per API key, model and day (TRIOSHED_API_KEY: the key asking)")
    p.add_argument("--key", help="one key's usage (a user key: its own only)")
    p.add_argument("--model", help="one model's usage")
    p.add_argument("--since", help="from this time: YYYY-MM-DD, RFC 3339 or Unix seconds")
    p.add_argument("--until", help="until this time (excluded)")
    p.add_argument("--by", choices=("day", "hour"), default="day")
    p.add_argument("--csv", action="store_true", help="CSV instead of a table")

    keys_cli.add_parser(sub)  # trioshed keys create|list|update|revoke|rotate

    p = command("help", "help about any command", epilog="")
    p.add_argument("topic", metavar="COMMAND", nargs="?")
    return parser


COMMANDS = {
    "serve": _cmd_serve, "start": _cmd_serve, "show": _cmd_show, "run": _cmd_run, "stop": _cmd_stop,
    "pull": _cmd_pull, "create": _cmd_create, "push": _cmd_push, "list": _cmd_list, "ls": _cmd_list, "ps": _cmd_ps, "cp": _cmd_cp, "rm": _cmd_rm,
    "usage": _cmd_usage, "keys": keys_cli.run,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "help":
        if args.topic is None:
            parser.print_help()
            return 0
        if args.topic not in (*COMMANDS, "help"):
            parser.error(f"unknown command {args.topic!r}")
        parser.parse_args([args.topic, "--help"])  # prints the command's help and exits 0
    serving = args.command in ("serve", "start")
    if args.command is None and not args.version:
        parser.print_help()
        return 0
    logging.basicConfig(
        level=logging.DEBUG if serving and args.verbose else logging.INFO if serving else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        _say(f"Error: {exc}")
        return 2
    if args.version:
        print(_version_line(settings))
        return 0
    if settings.log_format != "text":
        from trioshed.logs import use_format

        use_format(settings.log_format)
    if serving:
        return _cmd_serve(args, settings)
    import httpx

    try:
        return COMMANDS[args.command](args, settings)
    except CommandError as exc:
        _say(f"Error: {exc}")
        return 1
    except httpx.ConnectError:
        _say(f"Error: could not connect to trioshed at {settings.host}:{settings.port}; is it running? (start it with `trioshed serve`)")
        return 1
    except httpx.HTTPError as exc:
        _say(f"Error: the connection to the server failed: {exc or type(exc).__name__}")
        return 1
    except json.JSONDecodeError:
        _say(f"Error: the server at {settings.host}:{settings.port} did not answer JSON; is it trioshed or Ollama?")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `trioshed run ... | head`: the reader went away
        sys.stderr.close()
        return 0
