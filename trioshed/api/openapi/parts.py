"""The small pieces every part of ``/openapi.json`` is written with (:mod:`trioshed.api.openapi.document`
and the modules it merges): the schema type, references, objects and the scalar types."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}


def ref(name: str) -> Schema:
    """A reference to ``components.schemas.<name>``."""
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: Schema, required: tuple[str, ...] = (), *, extra: bool = True) -> Schema:
    """An object with ``properties``; ``extra=False`` forbids fields not named."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if not extra:
        schema["additionalProperties"] = False
    return schema
