"""What a llama-server grammar can hold: tool schemas relaxed until it can (pure).

llama-server turns every tool's JSON schema into a grammar (llama.cpp's json-schema-to-grammar)
that constrains a tool call's arguments, and its grammar parser refuses a bounded repetition of
2,000 or more (``MAX_REPETITION_THRESHOLD``): a whole request then fails with ``400 Failed to
initialize samplers: failed to parse grammar``. Agents send such schemas: Claude Code's
``Workflow`` tool has a ``maxLength`` of 524,288. Anthropic, OpenAI and Ollama take them.

Measured on llama.cpp b10068 (one schema property at a time, offered as a tool, the largest value
that still loads): ``maxLength`` 1,999 and ``minLength`` 1,999 (``char{m,n}``), ``maxItems``
1,997 to 1,998 (``item ("," item){0,n-1}``, by the item's shape), ``minItems`` 2,000, a
``pattern`` quantifier ``{m,n}`` 1,999, nested or not (each group becomes its own rule, so
bounds never multiply), and a ``maxLength`` beside a ``format`` is ignored by the converter.
Integer ranges, enums and ``maxProperties`` build no repetition.

The same limit binds a structured answer's schema (Ollama's ``format``, OpenAI's
``response_format`` and ``text.format``): :func:`grammar_safe_response_format`.

:func:`grammar_safe_tools` therefore drops every such bound at or above :data:`REPETITION_LIMIT`
(1,997), and a ``pattern`` with a quantifier bound that large. Dropping a bound only widens what
the grammar accepts: the tool is still offered with the rest of its schema, the model sees the
relaxed schema, and a call that would have been valid still is. Only schema keywords are walked
(``properties``, ``items``, ``anyOf``, ``$defs``...): ``const``, ``enum``, ``default`` and
``examples`` hold data and stay as they are. A schema that needs no change is returned as the
same object.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REPETITION_LIMIT", "grammar_safe_response_format", "grammar_safe_schema", "grammar_safe_tools"]

#: The smallest count that is relaxed: ``maxItems`` 1,998 already fails for an array of objects.
REPETITION_LIMIT = 1997
_COUNTS = frozenset({"maxLength", "minLength", "maxItems", "minItems"})
#: Keywords whose value is a schema, a list of schemas, or a map of names to schemas; every
#: other keyword's value (``enum``, ``const``, ``default``, ``examples``, ``description``...) is
#: left alone, and so is a property that happens to be called ``maxLength``.
_SCHEMA = frozenset({"items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
                     "additionalItems", "unevaluatedItems", "unevaluatedProperties"})  # fmt: skip
_SCHEMAS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _pattern_too_large(pattern: str) -> bool:
    return any(int(n) >= REPETITION_LIMIT for m in _QUANTIFIER.finditer(pattern) for n in m.groups() if n)


def _too_large(key: str, value: Any) -> bool:
    if key in _COUNTS:
        return isinstance(value, int) and not isinstance(value, bool) and value >= REPETITION_LIMIT
    return key == "pattern" and isinstance(value, str) and _pattern_too_large(value)


def _each(values: Any, relax: Any) -> Any:
    """``values`` (a list, or a map's values) relaxed one by one; the same object when unchanged."""
    if isinstance(values, list):
        items = [relax(v) for v in values]
        return values if all(a is b for a, b in zip(items, values, strict=True)) else items
    if isinstance(values, Mapping):
        named = {k: relax(v) for k, v in values.items()}
        return values if all(named[k] is v for k, v in values.items()) else named
    return values


def grammar_safe_schema(schema: Any) -> Any:
    """``schema`` without the bounds a llama-server grammar cannot hold (the same object when it
    has none). Anything that is not a schema object (``true``, a malformed value) is returned as
    it is: llama-server judges it."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] | None = None
    for key, value in schema.items():
        if _too_large(key, value):
            out = dict(schema) if out is None else out
            del out[key]
            continue
        if key in _SCHEMA:
            relaxed = _each(value, grammar_safe_schema) if isinstance(value, list) else grammar_safe_schema(value)
        elif key in _SCHEMAS or key in _NAMED:
            relaxed = _each(value, grammar_safe_schema)
        else:
            continue
        if relaxed is not value:
            out = dict(schema) if out is None else out
            out[key] = relaxed
    return schema if out is None else out


def grammar_safe_tools(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """OpenAI-shaped function tools (``{"type": "function", "function": {"parameters": ...}}``)
    with their ``parameters`` made :func:`grammar_safe_schema`; other entries as they are."""
    out: list[Mapping[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and "parameters" in function:
            parameters = grammar_safe_schema(function["parameters"])
            if parameters is not function["parameters"]:
                tool = {**tool, "function": {**function, "parameters": parameters}}
        out.append(tool)
    return out


def grammar_safe_response_format(fmt: Any) -> Any:
    """OpenAI's ``response_format`` with its schema made :func:`grammar_safe_schema` (the same
    object when nothing changes): ``{"type": "json_schema", "json_schema": {"schema": ...}}``, and
    the ``schema`` llama-server also takes beside ``json_object``. A structured answer's bound
    that a grammar cannot hold (a string of 2,000 characters or more, say) is then not enforced,
    where llama-server would refuse the whole request."""
    if not isinstance(fmt, Mapping):
        return fmt
    spec = fmt.get("json_schema")
    if isinstance(spec, Mapping) and "schema" in spec:
        schema = grammar_safe_schema(spec["schema"])
        return fmt if schema is spec["schema"] else {**fmt, "json_schema": {**spec, "schema": schema}}
    if "schema" in fmt:
        schema = grammar_safe_schema(fmt["schema"])
        return fmt if schema is fmt["schema"] else {**fmt, "schema": schema}
    return fmt
