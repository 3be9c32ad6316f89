"""The ``trioshed`` command, with Ollama's verbs and flags where they mean the same.

``serve`` runs the server (:mod:`~trioshed.cli.serve`); the others are small clients of a running
one (``TRIOSHED_HOST``, :mod:`~trioshed.cli.client`), printing what ``ollama`` prints
(:mod:`~trioshed.cli.format`): ``run`` and its chat (:mod:`~trioshed.cli.chat`), the store's verbs
``pull``/``create``/``push``/``cp``/``rm`` (:mod:`~trioshed.cli.store`), and the queries
``list``/``ps``/``show``/``stop``/``usage`` (:mod:`~trioshed.cli.queries`), and ``keys``, the
shared store's API keys (:mod:`~trioshed.cli.keys`). Every verb is a function of the parsed
flags and the settings that returns the exit status or raises
:class:`~trioshed.cli.client.CommandError`; :func:`main` parses, reads the settings, calls it and
turns every error into one line, ``Error: ...``, with exit status 1 (2 for a bad command line or
setting); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from trioshed.cli.chat import cmd_run
from trioshed.cli.client import CommandError, say
from trioshed.cli.keys import cmd_keys
from trioshed.cli.parser import CLIENT_EPILOG, SERVE_EPILOG, build_parser, settings_from_args
from trioshed.cli.queries import cmd_list, cmd_ps, cmd_show, cmd_stop, cmd_usage, version_line
from trioshed.cli.serve import cmd_serve
from trioshed.cli.store import cmd_cp, cmd_create, cmd_pull, cmd_push, cmd_rm
from trioshed.config import Settings

__all__ = ["CLIENT_EPILOG", "COMMANDS", "SERVE_EPILOG", "CommandError", "build_parser", "main", "run_command", "settings_from_args"]

#: Every verb (and alias) and the function that does it.
COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "serve": cmd_serve, "start": cmd_serve, "show": cmd_show, "run": cmd_run, "stop": cmd_stop,
    "pull": cmd_pull, "create": cmd_create, "push": cmd_push, "list": cmd_list, "ls": cmd_list, "ps": cmd_ps, "cp": cmd_cp, "rm": cmd_rm,
    "usage": cmd_usage, "keys": cmd_keys,
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
        say(f"Error: {exc}")
        return 2
    if args.version:
        print(version_line(settings))
        return 0
    if settings.log_format != "text":
        from trioshed.logs import use_format

        use_format(settings.log_format)
    if serving:
        return cmd_serve(args, settings)
    return run_command(COMMANDS[args.command], args, settings)


def run_command(command: Callable[[argparse.Namespace, Settings], int], args: argparse.Namespace, settings: Settings) -> int:
    """A client verb's exit status: its own, or 1 with one ``Error: ...`` line for what went
    wrong (130 when interrupted; 0 when the reader of its output went away)."""
    import httpx

    try:
        return command(args, settings)
    except CommandError as exc:
        say(f"Error: {exc}")
        return 1
    except httpx.ConnectError:
        say(f"Error: could not connect to trioshed at {settings.host}:{settings.port}; is it running? (start it with `trioshed serve`)")
        return 1
    except httpx.HTTPError as exc:
        say(f"Error: the connection to the server failed: {exc or type(exc).__name__}")
        return 1
    except json.JSONDecodeError:
        say(f"Error: the server at {settings.host}:{settings.port} did not answer JSON; is it trioshed or Ollama?")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `trioshed run ... | head`: the reader went away
        sys.stderr.close()
        return 0
