"""``/api/keys``: the API keys of the shared store, managed by an admin key (every route here is
admin-only: :data:`trioshed.access.USER_ROUTES` lists none of them).

- ``POST /api/keys`` ``{"name", "role", "weight", "models", <limits and budgets>}``: a new key; the
  answer holds its secret, once (the store keeps a digest: :func:`trioshed.keys.digest`). 201.
- ``GET /api/keys``: every key of the store (names, roles, limits, models, budgets, created,
  last used, revoked) and never a secret.
- ``PATCH /api/keys/<name>``: change its role, weight, models, limits or budgets (0: none).
- ``DELETE /api/keys/<name>``: revoke it (refused on every node within the keys' refresh).
- ``POST /api/keys/<name>/rotate``: a new secret for it (the old one stops working).

Errors are Ollama's ``{"error": message}``: 400 a bad field, 403 a server without API keys (its
first key is ``TRIOSHED_API_KEY`` or the keys file's: a key made here would lock out every client
of a keyless server, and anyone reaching it could make one), 404 no such key, 409 the name is
taken, 503 the store cannot be reached. A change is in force on this node when the answer
comes, and on the others within :data:`trioshed.usage.keysync.KEYS_REFRESH` seconds.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from quart import Blueprint, Response, request

from trioshed.api.pipeline.preamble import state
from trioshed.errors import BadRequest, Conflict, Forbidden, TrioshedError
from trioshed.keys import ANONYMOUS, LIMIT_FIELDS, RESERVED, ROLES, check_glob, current_key, digest
from trioshed.usage.store import KeyRow

bp = Blueprint("keys", __name__)

_FIELDS = {"name", "role", "weight", "models", *LIMIT_FIELDS}


class KeyNotFound(TrioshedError):
    status = 404


class StoreUnavailable(TrioshedError):
    status = 503


def new_secret() -> str:
    """32 random bytes, URL-safe, with a prefix that says what it is."""
    return "tsk-" + secrets.token_urlsafe(32)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
        raise BadRequest("name must be letters, digits, '-' or '_' (at most 64)")
    if name == RESERVED:
        raise BadRequest(f"the name {name!r} is TRIOSHED_API_KEY's on every node: choose another")
    return name


def _not_reserved(name: str) -> str:
    """A key named in a path: TRIOSHED_API_KEY's ``default`` is no key of the store (400)."""
    if name == RESERVED:
        raise BadRequest(f"{RESERVED!r} is TRIOSHED_API_KEY's name on every node: it is not a key of the store, and cannot be changed here")
    return name


def check_fields(body: object, *, creating: bool) -> dict[str, Any]:
    """The fields of a key's body, checked as the keys file's are; BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("send a JSON object")
    unknown = set(body) - _FIELDS if creating else set(body) - (_FIELDS - {"name"})
    if unknown:
        raise BadRequest(f"unknown field {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}")
    out: dict[str, Any] = {}
    if "role" in body:
        if body["role"] not in ROLES:
            raise BadRequest('role must be "user" or "admin"')
        out["role"] = body["role"]
    if "weight" in body:
        w = body["weight"]
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
            raise BadRequest("weight must be a positive number")
        out["weight"] = float(w)
    if "models" in body:
        models = body["models"]
        if not isinstance(models, list):
            raise BadRequest("models must be a list of model names or patterns ([] for every model)")
        try:
            out["models"] = tuple(check_glob(m) for m in models)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    for f in LIMIT_FIELDS:
        if f in body:
            v = body[f]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadRequest(f"{f} must be a whole number, 0 for no limit")
            out.setdefault("limits", {})[f] = v
    return out


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def describe(row: KeyRow) -> dict[str, Any]:
    """A key as ``GET /api/keys`` shows it: everything but the secret and its digest."""
    return {
        "name": row.name, "role": row.role, "weight": row.weight, "models": list(row.models),
        **{f: row.limits.get(f, 0) for f in LIMIT_FIELDS},
        "source": row.source.partition("@")[0], "created": _iso(row.created), "updated": _iso(row.updated),
        "last_used": _iso(row.last_used), "revoked": _iso(row.revoked),
    }  # fmt: skip


async def _store(fn: Any) -> Any:
    usage = state().usage
    if usage is None or usage.db is None:
        raise StoreUnavailable("no key store: usage is off (TRIOSHED_USAGE=0) and no TRIOSHED_DATABASE is set")
    try:
        return await usage.call(fn)
    except OSError as exc:
        raise StoreUnavailable(f"the key store cannot be used now: {exc}") from None


async def _changed() -> None:
    sync = state().key_sync
    if sync is not None:
        await sync.load()  # in force here now; elsewhere within KEYS_REFRESH


def _json(body: object, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, content_type="application/json")


async def _body() -> object:
    return await request.get_json(force=True, silent=True)


@bp.before_request
async def _keys_in_use() -> None:
    if current_key.get() is ANONYMOUS:
        raise Forbidden(
            "this server has no API keys: managing keys needs an admin key; start it with "
            "TRIOSHED_API_KEY (or an admin key in TRIOSHED_KEYS_FILE)"
        )


@bp.post("/api/keys")
async def create() -> Response:
    settings = state().settings
    if settings.fleet_discovery == "peers" and not settings.database:
        raise Conflict(
            "this node is in a fleet without a shared store (TRIOSHED_PEERS, no TRIOSHED_DATABASE): a key made here "
            "would be unknown to the other nodes; give every node the same TRIOSHED_KEYS_FILE, or share a PostgreSQL TRIOSHED_DATABASE"
        )
    body = await _body()
    fields = check_fields(body, creating=True)
    assert isinstance(body, dict)
    name = check_name(body.get("name"))
    secret, now = new_secret(), time.time()
    row = KeyRow(name, digest(secret), fields.get("role", "user"), fields.get("weight", 1.0),
                 {f: v for f, v in fields.get("limits", {}).items() if v}, fields.get("models", ()), "api", now, now)  # fmt: skip
    if not await _store(lambda db: db.create_key(row)):
        raise Conflict(f"API key '{name}' exists: change it with PATCH /api/keys/{name}, or revoke it first")
    await _changed()
    return _json({**describe(row), "key": secret}, 201)


@bp.get("/api/keys")
async def list_keys() -> Response:
    rows = await _store(lambda db: db.keys())
    return _json({"keys": [describe(r) for r in rows]})


@bp.patch("/api/keys/<name>")
async def update(name: str) -> Response:
    _not_reserved(name)
    fields = check_fields(await _body(), creating=False)
    if not fields:
        raise BadRequest(f"nothing to change: send one of {', '.join(sorted(_FIELDS - {'name'}))}")
    row = await _store(lambda db: db.patch_key(name, fields, time.time()))  # read, merged and written in one transaction
    if row is None:
        raise KeyNotFound(f"no API key '{name[:100]}' in the store (GET /api/keys lists them)")
    await _changed()
    return _json(describe(row))


@bp.delete("/api/keys/<name>")
async def revoke(name: str) -> Response:
    _not_reserved(name)
    now = time.time()
    if not await _store(lambda db: db.update_key(name, {"revoked": now}, now)):
        raise KeyNotFound(f"no API key '{name[:100]}' in the store, or it is revoked already")
    await _changed()
    return _json({"name": name, "revoked": _iso(now)})


@bp.post("/api/keys/<name>/rotate")
async def rotate(name: str) -> Response:
    _not_reserved(name)
    secret = new_secret()
    if not await _store(lambda db: db.update_key(name, {"digest": digest(secret)}, time.time())):
        raise KeyNotFound(f"no API key '{name[:100]}' in the store, or it is revoked")
    await _changed()
    return _json({"name": name, "key": secret})
