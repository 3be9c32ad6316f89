"""``trioshed keys create|list|update|revoke|rotate``: the shared store's API keys, over
``/api/keys`` of a running trioshed (:mod:`trioshed.api.keys`), with an admin key
(``TRIOSHED_API_KEY``). ``create`` and ``rotate`` print the secret once: the store keeps only its
digest. :func:`add_parser` hooks the verbs into the command line's parser; :func:`run` runs one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from trioshed.config import Settings
from trioshed.keys import LIMIT_FIELDS

if TYPE_CHECKING:
    import httpx

_COLUMNS = ("name", "role", "weight", "models", "tokens_per_day", "tokens_per_minute", "requests_per_minute", "created", "last_used", "revoked")


def _limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=("user", "admin"))
    p.add_argument("--weight", type=float, help="share of runner slots against other keys")
    p.add_argument("--models", dest="patterns", metavar="PATTERN", nargs="*", help="the models it may use (glob patterns; none: every model)")
    for f in LIMIT_FIELDS:
        p.add_argument(f"--{f.replace('_', '-')}", dest=f, type=int, metavar="N", help="0: no limit")


def add_parser(sub: Any) -> None:
    """The ``keys`` command and its verbs, in ``sub`` (the command line's subparsers)."""
    keys = sub.add_parser("keys", help="manage the API keys of the store (admin; TRIOSHED_API_KEY: the key asking)",
                          description="Manage the API keys of the store (admin): create, list, update, revoke, rotate.")  # fmt: skip
    verbs = keys.add_subparsers(dest="keys_verb", metavar="VERB", required=True, parser_class=type(keys))
    p = verbs.add_parser("create", help="a new key; its secret is printed once")
    p.add_argument("name", metavar="NAME")
    _limit_flags(p)
    p = verbs.add_parser("list", help="the keys (never a secret)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p = verbs.add_parser("update", help="change a key's role, weight, models, limits or budgets")
    p.add_argument("name", metavar="NAME")
    _limit_flags(p)
    verbs.add_parser("revoke", help="revoke a key on every node").add_argument("name", metavar="NAME")
    verbs.add_parser("rotate", help="a new secret for a key (printed once); the old one stops working").add_argument("name", metavar="NAME")


def _client(settings: Settings) -> httpx.Client:
    import httpx  # here: ``--help`` answers without it

    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    host = "127.0.0.1" if host in ("0.0.0.0", "[::]") else host
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.Client(base_url=f"http://{host}:{settings.port}", timeout=30, headers=headers)


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    out = {f: getattr(args, f) for f in ("role", "weight", *LIMIT_FIELDS) if getattr(args, f, None) is not None}
    if args.patterns is not None:  # not "models": the serve flag's name (a folder)
        out["models"] = args.patterns
    return out


def _answer(response: httpx.Response) -> dict[str, Any] | None:
    """The JSON answer, or None after printing its error (``Error: ...`` on stderr)."""
    if response.status_code >= 400:
        try:
            message = response.json().get("error", response.text)
        except ValueError:
            message = response.text
        print(f"Error: {message}", file=sys.stderr)
        return None
    body: dict[str, Any] = response.json()
    return body


def create(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        body = _answer(client.post("/api/keys", json={"name": args.name, **_fields(args)}))
    if body is None:
        return 1
    print(f"created API key '{body['name']}'; its secret (shown once, keep it):\n{body['key']}")
    return 0


def list_(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        body = _answer(client.get("/api/keys"))
    if body is None:
        return 1
    if args.json:
        print(json.dumps(body["keys"], indent=2))
        return 0
    print("\t".join(c.upper() for c in _COLUMNS))
    for k in body["keys"]:
        print("\t".join(",".join(k[c]) or "*" if c == "models" else str(k.get(c) if k.get(c) is not None else "-") for c in _COLUMNS))
    return 0


def update(args: argparse.Namespace, settings: Settings) -> int:
    fields = _fields(args)
    if not fields:
        print("Error: nothing to change: give --role, --weight, --models or a limit", file=sys.stderr)
        return 2
    with _client(settings) as client:
        body = _answer(client.patch(f"/api/keys/{args.name}", json=fields))
    if body is None:
        return 1
    print(f"updated API key '{body['name']}'")
    return 0


def revoke(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        body = _answer(client.delete(f"/api/keys/{args.name}"))
    if body is None:
        return 1
    print(f"revoked API key '{body['name']}' (every node refuses it within seconds)")
    return 0


def rotate(args: argparse.Namespace, settings: Settings) -> int:
    with _client(settings) as client:
        body = _answer(client.post(f"/api/keys/{args.name}/rotate"))
    if body is None:
        return 1
    print(f"new secret for API key '{body['name']}' (shown once; the old one no longer works):\n{body['key']}")
    return 0


VERBS = {"create": create, "list": list_, "update": update, "revoke": revoke, "rotate": rotate}


def run(args: argparse.Namespace, settings: Settings) -> int:
    return VERBS[args.keys_verb](args, settings)
