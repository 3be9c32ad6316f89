"""Tool schemas relaxed to what a llama-server grammar holds (pure; the cutoffs themselves are
checked against the real binary in ``tests/e2e/test_tool_schemas_e2e.py``)."""

from __future__ import annotations

import copy

from trioshed.core.grammar import (
    REPETITION_LIMIT,
    grammar_safe_response_format,
    grammar_safe_schema,
    grammar_safe_tools,
)

BIG = REPETITION_LIMIT
KEPT = REPETITION_LIMIT - 1

#: Claude Code's Workflow tool, as it sends it (the parts that matter here).
WORKFLOW = {
    "type": "object",
    "properties": {
        "workflow_id": {"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"},
        "script": {"type": "string", "maxLength": 524288, "description": "at most 512 KiB"},
        "names": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 32},
    },
    "required": ["script"],
}


def test_bounds_a_grammar_cannot_hold_are_dropped_and_the_rest_kept() -> None:
    relaxed = grammar_safe_schema(WORKFLOW)
    assert relaxed["properties"]["script"] == {"type": "string", "description": "at most 512 KiB"}
    assert relaxed["properties"]["workflow_id"] == WORKFLOW["properties"]["workflow_id"]  # {6,}: small
    assert relaxed["properties"]["names"] == WORKFLOW["properties"]["names"]
    assert relaxed["required"] == ["script"]
    assert WORKFLOW["properties"]["script"]["maxLength"] == 524288  # the caller's schema is not changed


def test_each_count_keyword_at_the_limit_is_dropped_and_one_below_kept() -> None:
    for key, base in (("maxLength", {"type": "string"}), ("minLength", {"type": "string"}),
                      ("maxItems", {"type": "array"}), ("minItems", {"type": "array"})):  # fmt: skip
        assert grammar_safe_schema({**base, key: BIG}) == base
        kept = {**base, key: KEPT}
        assert grammar_safe_schema(kept) is kept


def test_a_pattern_with_a_large_quantifier_is_dropped() -> None:
    for pattern in (f"^a{{{BIG}}}$", f"^a{{0,{BIG}}}$", f"^(ab){{{BIG},}}$", f"^x{{1, {BIG * 10}}}$"):
        assert grammar_safe_schema({"type": "string", "pattern": pattern}) == {"type": "string"}
    for pattern in (f"^a{{0,{KEPT}}}$", "^[0-9]{4}-[0-9]{2}$", "^a{2,}$", r"^\{[a-z]+\}$"):
        kept = {"type": "string", "pattern": pattern}
        assert grammar_safe_schema(kept) is kept


def test_every_place_a_schema_can_hold_a_schema_is_walked() -> None:
    s = {"type": "string", "maxLength": BIG}
    plain = {"type": "string"}
    schema = {
        "type": "object",
        "properties": {"a": s, "b": {"type": "array", "items": s, "prefixItems": [s]}},
        "patternProperties": {"^x": s},
        "additionalProperties": s,
        "anyOf": [s, {"type": "integer"}],
        "oneOf": [s],
        "allOf": [{"not": s}],
        "$defs": {"d": s},
        "definitions": {"d": s},
        "if": s, "then": s, "else": s,
        "items": [s],  # the older tuple form
    }  # fmt: skip
    relaxed = grammar_safe_schema(schema)
    assert relaxed["properties"] == {"a": plain, "b": {"type": "array", "items": plain, "prefixItems": [plain]}}
    assert relaxed["patternProperties"] == {"^x": plain} and relaxed["additionalProperties"] == plain
    assert relaxed["anyOf"] == [plain, {"type": "integer"}] and relaxed["oneOf"] == [plain]
    assert relaxed["allOf"] == [{"not": plain}] and relaxed["$defs"] == relaxed["definitions"] == {"d": plain}
    assert relaxed["if"] == relaxed["then"] == relaxed["else"] == plain and relaxed["items"] == [plain]


def test_data_and_property_names_are_not_schemas() -> None:
    schema = {
        "type": "object",
        "properties": {"maxLength": {"type": "integer"}, "pattern": {"type": "string", "default": "x{5000}"}},
        "default": {"maxLength": BIG},
        "examples": [{"maxLength": BIG}],
        "enum": [{"maxLength": BIG}],
        "const": {"maxItems": BIG},
        "description": "maxLength 5000",
    }
    assert grammar_safe_schema(schema) is schema


def test_anything_else_passes_as_it_is() -> None:
    for value in (True, None, 3, "a", [], {"maxLength": "many"}, {"maxLength": True}, {"pattern": 5}):
        assert grammar_safe_schema(value) is value


def test_tools_keep_their_names_descriptions_and_order() -> None:
    tools = [
        {"type": "function", "function": {"name": "Workflow", "description": "runs one", "parameters": WORKFLOW}},
        {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "none"}},
        {"type": "web_search"},
    ]
    before = copy.deepcopy(tools)
    relaxed = grammar_safe_tools(tools)
    assert tools == before
    assert [t.get("function", {}).get("name") for t in relaxed] == ["Workflow", "Read", "none", None]
    assert relaxed[0]["function"]["description"] == "runs one"
    assert "maxLength" not in relaxed[0]["function"]["parameters"]["properties"]["script"]
    assert relaxed[1:] == tools[1:] and all(a is b for a, b in zip(relaxed[1:], tools[1:], strict=True))


def test_a_response_formats_schema_is_relaxed_in_either_shape() -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 524288}}}
    relaxed = {"type": "object", "properties": {"text": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    assert grammar_safe_response_format(fmt) == {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": relaxed}}
    assert grammar_safe_response_format({"type": "json_object", "schema": schema}) == {"type": "json_object", "schema": relaxed}
    for unchanged in ({"type": "json_schema", "json_schema": {"schema": relaxed}}, {"type": "json_object"}, {"type": "text"}, None, "json"):
        assert grammar_safe_response_format(unchanged) is unchanged
