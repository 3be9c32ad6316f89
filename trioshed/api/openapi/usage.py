"""The OpenAPI description of ``GET /api/usage`` (:mod:`trioshed.api.routes.usage`), merged into
``/openapi.json`` by :mod:`trioshed.api.openapi.document`."""

from __future__ import annotations

from trioshed.api.openapi.parts import Schema

_ROW: Schema = {
    "type": "object",
    "properties": {
        "key": {"type": "string"}, "model": {"type": "string"}, "node": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
        **{n: {"type": "integer"} for n in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")},
        "seconds": {"type": "number"},
    },
}  # fmt: skip

_ERROR: Schema = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}}}}}


def _param(name: str, description: str, schema: Schema | None = None) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema or {"type": "string"}}


def usage_paths() -> dict[str, Schema]:
    return {
        "/api/usage": {
            "get": {
                "summary": "Requests and tokens per API key, model and day or hour (a user key: its own)",
                "parameters": [
                    _param("key", "one key's usage"), _param("model", "one model's usage"),
                    _param("node", "one node's rows (default: every node's, a row per node)"),
                    _param("since", "from: RFC 3339, YYYY-MM-DD (UTC) or Unix seconds"),
                    _param("until", "to (excluded), as since"),
                    _param("by", "day (default) or hour (the last 14 days)", {"type": "string", "enum": ["day", "hour"]}),
                    _param("format", "json (default) or csv", {"type": "string", "enum": ["json", "csv"]}),
                ],
                "responses": {
                    "200": {"description": "OK", "content": {
                        "application/json": {"schema": {"type": "object", "properties": {
                            "by": {"type": "string"}, "usage": {"type": "array", "items": _ROW},
                            "keys": {"type": "array", "items": {"type": "object"}}}}},
                        "text/csv": {"schema": {"type": "string"}}}},
                    "400": {"description": "A bad parameter.", "content": _ERROR},
                    "401": {"description": "The API key is missing or wrong.", "content": _ERROR},
                    "403": {"description": "A user key asking for another key's usage.", "content": _ERROR},
                    "503": {"description": "The usage database cannot be read now.", "content": _ERROR},
                },
            }
        }
    }  # fmt: skip
