"""The OpenAPI description of ``/api/keys`` (:mod:`trioshed.api.routes.keys`), merged into
``/openapi.json`` by :mod:`trioshed.api.openapi.document`."""

from __future__ import annotations

from trioshed.api.openapi.parts import Schema
from trioshed.keys import LIMIT_FIELDS

_ERROR: Schema = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}}}}}
_FIELDS: Schema = {
    "role": {"type": "string", "enum": ["user", "admin"]},
    "weight": {"type": "number", "exclusiveMinimum": 0},
    "models": {"type": "array", "items": {"type": "string"}},
    **{f: {"type": "integer", "minimum": 0} for f in LIMIT_FIELDS},
}
_KEY: Schema = {"type": "object", "properties": {"name": {"type": "string"}, **_FIELDS,
                "source": {"type": "string"}, "created": {"type": "string"}, "last_used": {"type": ["string", "null"]},
                "revoked": {"type": ["string", "null"]}}}  # fmt: skip
_NAME: Schema = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}


def _answers(ok: str, schema: Schema, *errors: str) -> Schema:
    words = {"400": "A bad field, or the name `default` (TRIOSHED_API_KEY's on every node).", "401": "The API key is missing or wrong.",
             "403": "Not an admin key.", "404": "No such key (or it is revoked).",
             "409": "The name is taken, or this node is in a fleet without a shared store (a key made here would be unknown to the others).",
             "503": "The key store cannot be reached."}  # fmt: skip
    out: Schema = {ok: {"description": "OK", "content": {"application/json": {"schema": schema}}}}
    for code in ("401", "403", "503", *errors):
        out[code] = {"description": words[code], "content": _ERROR}
    return out


def keys_paths() -> dict[str, Schema]:
    secret: Schema = {"type": "object", "properties": {"name": {"type": "string"}, "key": {"type": "string"}}}
    body: Schema = {"required": True, "content": {"application/json": {"schema": {"type": "object", "properties": _FIELDS}}}}
    return {
        "/api/keys": {
            "get": {"summary": "The store's API keys, never a secret (admin)", "responses": _answers(
                "200", {"type": "object", "properties": {"keys": {"type": "array", "items": _KEY}}})},
            "post": {"summary": "A new API key; its secret is in this answer only (admin)",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, **_FIELDS}}}}},
                     "responses": _answers("201", _KEY, "400", "409")},
        },
        "/api/keys/{name}": {
            "patch": {"summary": "Change a key's role, weight, models, limits or budgets (admin)", "parameters": [_NAME],
                      "requestBody": body, "responses": _answers("200", _KEY, "400", "404")},
            "delete": {"summary": "Revoke a key on every node (admin)", "parameters": [_NAME],
                       "responses": _answers("200", {"type": "object"}, "400", "404")},
        },
        "/api/keys/{name}/rotate": {
            "post": {"summary": "A new secret for a key; the old one stops working (admin)", "parameters": [_NAME],
                     "responses": _answers("200", secret, "400", "404")},
        },
    }  # fmt: skip
