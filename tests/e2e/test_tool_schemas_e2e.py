"""Tool schemas whose limits a llama-server grammar cannot hold (Claude Code's ``Workflow`` tool:
``maxLength`` 524,288) are relaxed before the grammar is built, on every protocol that passes
tools, and the tool is still offered. The cutoffs in :mod:`trioshed.core.grammar` are checked
against the real binary alone: one below them loads, at them it fails."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from trioshed.core.grammar import REPETITION_LIMIT
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import TOOLS_TEMPLATE, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

SCRIPT = {"type": "string", "maxLength": 524288, "description": "the workflow's script"}
SCHEMA = {"type": "object", "properties": {"script": SCRIPT, "id": {"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"}}, "required": ["script"]}


def _status(url: str, schema: dict[str, Any]) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


#: (a property, the first count llama-server b10068 refuses): maxLength, minLength and a pattern's
#: quantifier fail at 2,000, maxItems of objects at 1,998, minItems at 2,001.
CUTOFFS: list[tuple[Callable[[int], dict[str, Any]], int]] = [
    (lambda n: {"type": "string", "maxLength": n}, 2000),
    (lambda n: {"type": "string", "minLength": n}, 2000),
    (lambda n: {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "string"}}}, "maxItems": n}, 1998),
    (lambda n: {"type": "array", "items": {"type": "string"}, "minItems": n}, 2001),
    (lambda n: {"type": "string", "pattern": f"^a{{0,{n}}}$"}, 2000),
]


def test_the_cutoffs_are_llama_servers(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "t.gguf", chat_template=TOOLS_TEMPLATE)
    with running_llama_server(model, ["-c", "512", "-t", "1", "-ngl", "0", "--fit", "off", "--jinja"]) as server:
        for prop, refused in CUTOFFS:
            def schema(n: int, prop: Callable[[int], dict[str, Any]] = prop) -> dict[str, Any]:
                return {"type": "object", "properties": {"a": prop(n)}}
            assert _status(server.url, schema(refused - 1)) == 200, prop(refused - 1)
            assert _status(server.url, schema(refused)) == 400, prop(refused)
            assert REPETITION_LIMIT <= refused  # what trioshed drops is at or past the cutoff; what it keeps loads
        assert _status(server.url, SCHEMA) == 400  # Claude Code's Workflow schema, as it is


async def test_every_protocol_offers_the_tool_with_its_limits_relaxed(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "t.gguf", chat_template=TOOLS_TEMPLATE)
    with trio.fail_after(120):
        async with open_test_server(tmp_path) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            openai_tool = {"type": "function", "function": {"name": "Workflow", "description": "runs a workflow", "parameters": SCHEMA}}
            r = await http.post("/api/chat", json={"model": "t", "messages": [{"role": "user", "content": "hi"}], "tools": [openai_tool],
                                                  "options": {"num_predict": 2}, "stream": False})  # fmt: skip
            assert r.status_code == 200 and r.json()["done"], r.text
            r = await http.post("/v1/chat/completions", json={"model": "t", "messages": [{"role": "user", "content": "hi"}],
                                                            "tools": [openai_tool], "max_tokens": 2, "stream": True})  # fmt: skip
            assert r.status_code == 200 and "data: [DONE]" in r.text and '"error"' not in r.text, r.text
            r = await http.post("/v1/responses", json={"model": "t", "input": "hi", "max_output_tokens": 2,
                                                     "tools": [{"type": "function", "name": "Workflow", "parameters": SCHEMA}]})  # fmt: skip
            assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
            client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="x", max_retries=0)
            async with client.messages.stream(model="t", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                              tools=[{"name": "Workflow", "description": "runs a workflow", "input_schema": SCHEMA}]) as stream:  # type: ignore[list-item]  # fmt: skip
                message = await stream.get_final_message()
            assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
            # the tool is offered: the prompt renders its schema, less exactly the bound dropped
            async def counted(tools: list[Any]) -> int:
                count = await client.messages.count_tokens(model="t", messages=[{"role": "user", "content": "hi"}], tools=tools)
                return count.input_tokens
            relaxed = {**SCHEMA, "properties": {**SCHEMA["properties"], "script": {"type": "string", "description": "the workflow's script"}}}  # type: ignore[dict-item]
            sent = await counted([{"name": "Workflow", "input_schema": SCHEMA}])
            assert sent == await counted([{"name": "Workflow", "input_schema": relaxed}]) > await counted([]) + 40
            await client.close()
            chat = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
            done = await chat.chat.completions.create(model="t", messages=[{"role": "user", "content": "hi"}], tools=[openai_tool], max_tokens=2)  # type: ignore[list-item]
            assert done.choices[0].finish_reason in ("length", "stop", "tool_calls")
            await chat.close()


ANSWER = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 100000}}, "required": ["summary"]}


async def test_a_structured_answers_schema_with_limits_a_grammar_cannot_hold_is_served(tmp_path: Path) -> None:
    """The same bounds in a structured answer's schema (Ollama's ``format``, OpenAI's
    ``response_format`` and ``text.format``), with a chat template and without one: answered,
    and still constrained by the rest of the schema (the answer opens the JSON object)."""
    write_tiny_model(tmp_path / "t.gguf", chat_template=TOOLS_TEMPLATE)
    write_tiny_model(tmp_path / "b.gguf")  # no chat template: the plain transcript
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    hi = [{"role": "user", "content": "hi"}]
    with trio.fail_after(180):
        async with open_test_server(tmp_path) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for model in ("t", "b"):
                texts = []
                r = await http.post("/api/chat", json={"model": model, "messages": hi, "format": ANSWER, "stream": False, "options": {"num_predict": 8, "temperature": 0}})
                assert r.status_code == 200, r.text
                texts.append(r.json()["message"]["content"])
                r = await http.post("/api/generate", json={"model": model, "prompt": "hi", "format": ANSWER, "stream": False, "options": {"num_predict": 8, "temperature": 0}})
                assert r.status_code == 200, r.text
                texts.append(r.json()["response"])
                for stream in (False, True):
                    r = await http.post("/v1/chat/completions", json={"model": model, "messages": hi, "response_format": fmt, "max_tokens": 8, "temperature": 0, "stream": stream})
                    assert r.status_code == 200 and '"error"' not in r.text, r.text
                    if not stream:
                        texts.append(r.json()["choices"][0]["message"]["content"])
                r = await http.post("/v1/completions", json={"model": model, "prompt": "hi", "response_format": fmt, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
                r = await http.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 8, "temperature": 0,
                                                         "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}})  # fmt: skip
                assert r.status_code == 200, r.text
                texts.append(r.json()["output"][0]["content"][0]["text"])
                # the grammar holds each answer to the object (white space is JSON's too)
                assert all(text.strip().startswith("{") for text in texts), (model, texts)
