"""``trioshed serve``: check what the server needs (the runner binary, the store folders, the RPC
servers' addresses), put the demo model in place when asked, then run the server until it stops.

Each problem found before the server starts is one line, ``Error: ...``: exit status 1 for a
missing binary or demo model, 2 for a setting that cannot work.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from trioshed import __version__
from trioshed.cli.client import say
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


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until stopped (then leave at once, :func:`exit_now`); the exit status of a problem
    found before the server starts."""
    from trioshed.runner.binary import BinaryNotFound, find_llama_server

    try:
        binary = find_llama_server(settings.llama_server)
    except BinaryNotFound as exc:
        say(f"Error: {exc}")
        return 1
    from trioshed.models.ollama_store import is_ollama_store
    from trioshed.models.stores import store_folders

    folders = [f for f in store_folders(settings.models) if not is_ollama_store(f)]
    for folder in folders:
        if problem := unusable_store(folder):
            say(f"Error: TRIOSHED_MODELS: {folder}: {problem}")
            return 2
    assembly = None
    if folders and args.demo_model:
        from trioshed.models.demo import start_demo_assembly

        assembly = start_demo_assembly(folders[0], say)  # a thread, while the server imports
    import trio

    from trioshed.models.demo import DemoUnavailable
    from trioshed.server import serve

    if assembly is not None:
        try:
            assembly.wait()
        except DemoUnavailable as exc:
            say(f"Error: {exc}")
            return 1
    banner = f"trioshed {__version__}: serving {settings.models} on http://{settings.host}:{settings.port}"
    if settings.log_format == "json":
        logging.getLogger("trioshed").info(banner)  # every line of a JSON log is JSON
    else:
        say(banner)
    if args.demo_model and settings.log_format != "json":
        from trioshed.models.demo import demo_hint

        if hint := demo_hint(folders):
            say(hint)
    from trioshed.devices.rpc import check_addresses

    try:  # a public RPC server address, or fleet certificates that cannot be read, refused before anything starts
        trio.run(lambda: check_addresses(settings.rpc_servers, allow_public=settings.rpc_allow_public))
        if settings.fleet_discovery:
            from trioshed.fleet import fleet_tls

            fleet_tls(settings)  # TRIOSHED_FLEET_CA
    except ValueError as exc:
        say(f"Error: {exc}")
        return 2
    trio.run(lambda: serve(settings, binary=binary, settle_heap=True))
    exit_now(0)
    return 0  # pragma: no cover - not reached


def exit_now(code: int) -> NoReturn:
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
