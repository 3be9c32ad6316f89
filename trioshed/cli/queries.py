"""The commands that ask the server and print its answer: ``list``, ``ps``, ``show``, ``stop``,
``usage`` and the server's version, printed as ``ollama`` prints them
(:mod:`trioshed.cli.format`).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from trioshed import __version__
from trioshed.cli.client import CommandError, checked, open_client
from trioshed.cli.format import list_table, ps_table, show_text
from trioshed.config import Settings

if TYPE_CHECKING:
    import httpx

#: What ``show --FIELD`` prints when the model has none (Ollama's words).
SHOW_NONE = {
    "license": "No license was specified for this model.",
    "modelfile": "No Modelfile was specified for this model.",
    "parameters": "No parameters were specified for this model.",
    "system": "No system message was specified for this model.",
    "template": "No prompt template was specified for this model.",
}

USAGE_COLUMNS = ("key", "model", "start", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds", "node")


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        answer = checked(client.get("/api/tags")).json()
    print(list_table(answer, datetime.now(UTC)), end="")
    return 0


def cmd_ps(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        answer = checked(client.get("/api/ps")).json()
    print(ps_table(answer, datetime.now(UTC)), end="")
    return 0


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    fields = [f for f in SHOW_NONE if getattr(args, f)]
    if len(fields) > 1:
        raise CommandError("only one of --license, --modelfile, --parameters, --system or --template may be given")
    with open_client(settings) as client:
        answer = checked(client.post("/api/show", json={"model": args.model})).json()
    if fields:
        text = str(answer.get(fields[0]) or "")
        print(text.rstrip("\n") if text else SHOW_NONE[fields[0]])
        return 0
    print(show_text(answer, verbose=args.verbose), end="")
    return 0


def loaded(client: httpx.Client, model: str) -> bool:
    """Whether ``model`` (``:latest`` where it names no tag) is among the server's running models."""
    names = {model, model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"}
    return any(m.get("name") in names or m.get("model") in names for m in checked(client.get("/api/ps")).json().get("models") or [])


def cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings) as client:
        if not loaded(client, args.model):
            raise CommandError(f'couldn\'t find model "{args.model}" to stop')
        checked(client.post("/api/generate", json={"model": args.model, "keep_alive": 0}))
    return 0


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    """Usage per key, model and day (or hour) from ``GET /api/usage``: a table, or its CSV."""
    params = {k: v for k, v in (("key", args.key), ("model", args.model), ("since", args.since),
                                ("until", args.until), ("by", args.by), ("node", args.node)) if v}  # fmt: skip
    if args.csv:
        params["format"] = "csv"
    with open_client(settings) as client:
        response = checked(client.get("/api/usage", params=params))
    if args.csv:
        print(response.text, end="")
        return 0
    body = response.json()
    print("\t".join(c.upper() for c in USAGE_COLUMNS))
    for row in body.get("usage", []):
        print("\t".join(str(row.get(c, "")) for c in USAGE_COLUMNS))
    budgets = [k for k in body.get("keys", []) if k.get("budgets")]
    if budgets:
        print()
        print("KEY\tBUDGET\tLIMIT\tLEFT")
        for k in budgets:
            for name, b in k["budgets"].items():
                print(f"{k['key']}\t{name}\t{b['limit']}\t{b['left']}")
    return 0


def version_line(settings: Settings) -> str:
    """``ollama -v``: this client's version, and the server's where one answers and differs."""
    import httpx

    line = f"trioshed version is {__version__}"
    try:
        with open_client(settings, timeout=2.0) as client:
            answer = client.get("/api/version").json()
            server = answer.get("trioshed_version") or answer.get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return line
    if server and server != __version__:
        line += f"\nWarning: the server at {settings.host}:{settings.port} is version {server}"
    return line
