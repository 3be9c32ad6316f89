"""``trioshed keys create|list|update|revoke|rotate``: the shared store's API keys, over
``/api/keys`` of a running trioshed (:mod:`trioshed.api.routes.keys`), asked with an admin key
(``TRIOSHED_API_KEY``). ``create`` and ``rotate`` print the secret once: the store keeps only its
digest. A refusal (no such key, a name taken, not an admin, the store unreachable) is the
server's message as one ``Error: ...`` line, exit status 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from trioshed.cli.client import CommandError, checked, open_client
from trioshed.config import Settings
from trioshed.keys import LIMIT_FIELDS

#: ``keys list``'s columns (``--json``: every field).
KEYS_COLUMNS = ("name", "role", "weight", "models", "tokens_per_day", "tokens_per_minute", "requests_per_minute", "created", "last_used", "revoked")


def key_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a key that the flags give (those not given are left out)."""
    out = {f: getattr(args, f) for f in ("role", "weight", *LIMIT_FIELDS) if getattr(args, f, None) is not None}
    if args.patterns is not None:  # not "models": the serve flag's name (a folder)
        out["models"] = args.patterns
    return out


def keys_table(keys: list[dict[str, Any]]) -> str:
    """``keys list``'s table: tab-separated, ``*`` for every model, ``-`` for none."""

    def cell(key: dict[str, Any], column: str) -> str:
        if column == "models":
            return ",".join(key.get("models") or []) or "*"
        value = key.get(column)
        return "-" if value is None else str(value)

    lines = ["\t".join(c.upper() for c in KEYS_COLUMNS)]
    lines += ["\t".join(cell(k, c) for c in KEYS_COLUMNS) for k in keys]
    return "\n".join(lines) + "\n"


def _create(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings, timeout=30) as client:
        body = checked(client.post("/api/keys", json={"name": args.name, **key_fields(args)})).json()
    print(f"created API key '{body['name']}'; its secret (shown once, keep it):\n{body['key']}")
    return 0


def _list(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings, timeout=30) as client:
        keys = checked(client.get("/api/keys")).json()["keys"]
    print(json.dumps(keys, indent=2) if args.json else keys_table(keys), end="\n" if args.json else "")
    return 0


def _update(args: argparse.Namespace, settings: Settings) -> int:
    fields = key_fields(args)
    if not fields:
        raise CommandError("nothing to change: give --role, --weight, --models or a limit")
    with open_client(settings, timeout=30) as client:
        body = checked(client.patch(f"/api/keys/{quote(args.name, safe='')}", json=fields)).json()
    print(f"updated API key '{body['name']}'")
    return 0


def _revoke(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings, timeout=30) as client:
        body = checked(client.delete(f"/api/keys/{quote(args.name, safe='')}")).json()
    print(f"revoked API key '{body['name']}' (every node refuses it within seconds)")
    return 0


def _rotate(args: argparse.Namespace, settings: Settings) -> int:
    with open_client(settings, timeout=30) as client:
        body = checked(client.post(f"/api/keys/{quote(args.name, safe='')}/rotate")).json()
    print(f"new secret for API key '{body['name']}' (shown once; the old one no longer works):\n{body['key']}")
    return 0


_VERBS = {"create": _create, "list": _list, "update": _update, "revoke": _revoke, "rotate": _rotate}


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    """``trioshed keys VERB``: one of :data:`_VERBS`."""
    return _VERBS[args.keys_verb](args, settings)
