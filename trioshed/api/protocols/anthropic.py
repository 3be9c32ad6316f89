"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the requests, without I/O.

A Messages request becomes one llama-server request (:func:`messages_upstream`):

* a model with a chat template: ``POST /v1/chat/completions``, so that llama-server applies the
  model's own template and parses its tool calls and reasoning. ``system`` (a string or text
  blocks) becomes a system message, and so do messages with ``role: "system"`` (Claude Code
  sends one for a model it does not know), folded after it in order: every chat template takes
  a system prompt first, not all take one between turns. A message's ``text`` and ``image`` blocks become content
  parts, its ``tool_use`` blocks an assistant's ``tool_calls``, its ``tool_result`` blocks
  ``tool`` messages (placed first: they answer the assistant's calls just before), its
  ``thinking`` blocks ``reasoning_content``. ``tools`` (``input_schema``) become functions;
  ``tool_choice`` ``auto``/``any``/``none`` become ``auto``/``required``/``none`` and ``tool``
  (one named tool) ``required`` with that tool alone, as llama-server knows no named choice.
  A schema's bounds that llama-server's grammar cannot hold (``maxLength`` 524,288) are dropped
  first (:mod:`trioshed.core.grammar`): the tool is offered with the rest of its schema.
* a model without one (a base model, like the demo's): ``POST /completion`` with the
  conversation as the plain transcript every protocol uses (``transcript.py``), cut at the next
  turn. Tools and images mean nothing there and are left out (the capability checks refuse them
  first); ``/completion`` reports which stop string ended the answer.

Both ask upstream to stream (a whole answer is aggregated, as the Ollama routes do) with
``return_progress``: llama-server's first events then say how long the prompt is and how much of
it was cached, so ``message_start`` carries the real ``input_tokens``.

``stop_sequences`` are matched by trioshed on the chat path (:class:`MessagesUpstream`
``stop_sequences``): llama-server's chat answer says ``finish_reason: "stop"`` both for the end of
the turn and for a stop string and never which string, while Anthropic's answer names it
(``stop_reason: "stop_sequence"``, ``stop_sequence``). On the transcript path ``/completion``'s
``stopping_word`` says it, so they go upstream.

``max_tokens`` is required (as Anthropic requires it); ``temperature``, ``top_p``, ``top_k`` pass
through; ``metadata`` and ``cache_control`` are accepted and ignored, and so is the billing line
Claude Code puts first in ``system`` (it changes every request and would defeat the prompt cache).
``thinking`` is honoured when the model can think (``thinking_capable``) and ignored otherwise:
Claude Code sends it by its own settings, whatever the model, and a refusal would make every
other local model unusable.

:func:`count_tokens_upstream` is the rendering that ``/v1/messages/count_tokens`` counts.
Validation errors are :class:`BadRequest` with Anthropic-style messages (``field: problem``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trioshed.api.protocols.llama import Upstream, has_part
from trioshed.api.protocols.options import json_type, require_object
from trioshed.api.protocols.transcript import (
    TURN_STOP,
    media_prompt,
    transcript_media,
    transcript_prompt,
)
from trioshed.core.grammar import grammar_safe_schema
from trioshed.errors import BadRequest

__all__ = [
    "MessagesUpstream",
    "TokenCount",
    "chat_messages",
    "count_tokens_upstream",
    "messages_upstream",
]

_ROLES = ("user", "assistant")
#: Anthropic's own tools, run by Anthropic's servers; a local model has no such thing.
_SERVER_TOOL_PREFIXES = ("web_search", "web_fetch", "code_execution", "bash_", "text_editor_", "computer_", "memory_")


@dataclass(frozen=True)
class MessagesUpstream:
    """The llama-server request for one Messages request, and what the answer's translation needs."""

    upstream: Upstream
    #: The client's stop sequences that :class:`~.anthropic_stream.MessageStream` matches itself
    #: (the chat path); empty on the transcript path, where llama-server matches them.
    stop_sequences: tuple[str, ...] = ()
    #: The stop string that means "end of turn" on the transcript path (not a client's sequence).
    turn_stop: str | None = None
    #: The final assistant message that llama-server continues (a prefill); its echo is stripped.
    prefill: str = ""
    stream: bool = False


@dataclass(frozen=True)
class TokenCount:
    """What ``/v1/messages/count_tokens`` counts: a chat body that llama-server's
    ``/apply-template`` renders (``template``), or, for a model without a template, the
    transcript text itself (``text``). Either is then counted by ``/tokenize``."""

    template: dict[str, Any] | None = None
    text: str | None = None
    runner_options: dict[str, Any] = field(default_factory=dict)


def _need(value: object, types: type | tuple[type, ...], where: str, words: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise BadRequest(f"{where}: Input should be {words}, got {json_type(value)}")
    return value


def _optional(req: Mapping[str, Any], key: str, types: type | tuple[type, ...], words: str) -> Any:
    value = req.get(key)
    return None if value is None else _need(value, types, key, words)


def _text(block: Mapping[str, Any], where: str) -> str:
    return str(_need(block.get("text"), str, f"{where}.text", "a valid string"))


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` part for an Anthropic image block (base64 only)."""
    source = _need(block.get("source"), Mapping, f"{where}.source", "an object")
    kind = source.get("type")
    if kind != "base64":
        raise BadRequest(f"{where}.source: only base64 images are supported here (got type {json.dumps(kind)}); "
                         "send the image's bytes as {\"type\": \"base64\", \"media_type\": ..., \"data\": ...}")
    media = _need(source.get("media_type", "image/png"), str, f"{where}.source.media_type", "a valid string")
    data = _need(source.get("data"), str, f"{where}.source.data", "a valid string")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{''.join(data.split())}"}}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``tool`` message for a ``tool_result`` block (its text; images as content parts)."""
    call_id = _need(block.get("tool_use_id"), str, f"{where}.tool_use_id", "a valid string")
    content = block.get("content")
    out: dict[str, Any] = {"role": "tool", "tool_call_id": call_id}
    if content is None or isinstance(content, str):
        out["content"] = content or ""
        return out
    parts: list[dict[str, Any]] = []
    for k, item in enumerate(_need(content, list, f"{where}.content", "a valid string or list")):
        at = f"{where}.content.{k}"
        item = _need(item, Mapping, at, "an object")
        if item.get("type") == "text":
            parts.append({"type": "text", "text": _text(item, at)})
        elif item.get("type") == "image":
            parts.append(_image_part(item, at))
        else:
            raise BadRequest(f"{at}.type: a tool result holds text and image blocks, got {json.dumps(item.get('type'))}")
    if all(p["type"] == "text" for p in parts):
        out["content"] = "".join(p["text"] for p in parts)
    else:
        out["content"] = parts
    return out


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = _need(block.get("id"), str, f"{where}.id", "a valid string")
    name = _need(block.get("name"), str, f"{where}.name", "a valid string")
    arguments = block.get("input", {})
    _need(arguments, Mapping, f"{where}.input", "a valid dictionary")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _message(raw: object, i: int) -> list[dict[str, Any]]:
    """The OpenAI chat messages for one Anthropic message (tool results first, then the rest)."""
    where = f"messages.{i}"
    message: Mapping[str, Any] = _need(raw, Mapping, where, "a valid dictionary")
    role = message.get("role")
    if role not in _ROLES:  # Anthropic's own words (Claude Code recognizes them)
        raise BadRequest(f"{where}.role: Input should be 'user' or 'assistant'")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = _need(content, list, f"{where}.content", "a valid string or list of content blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        block = _need(block, Mapping, at, "a valid dictionary")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(_need(block.get("thinking", ""), str, f"{at}.thinking", "a valid string")))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise BadRequest(f"{at}: a {kind} block belongs in a message with role "
                             f"'{'user' if kind == 'tool_result' else 'assistant'}', not {json.dumps(role)}")
        else:
            raise BadRequest(f"{at}.type: unsupported content block type {json.dumps(kind)}; "
                             "supported: text, image, tool_use, tool_result, thinking")
    out: list[dict[str, Any]] = list(results)
    if parts or calls or thinking or not results:
        text_only = all(p["type"] == "text" for p in parts)
        body: dict[str, Any] = {"role": role, "content": "".join(p["text"] for p in parts) if text_only else parts}
        if calls:
            body["tool_calls"] = calls
        if thinking:
            body["reasoning_content"] = "".join(thinking)
        out.append(body)
    return out


#: How Claude Code's first system block starts: billing metadata for Anthropic with a hash that
#: changes every request (``cch=...``); left in, it would spoil llama-server's prompt cache from
#: the top of the prompt on, so every turn would evaluate the whole ~20k-token prompt again.
_BILLING_HEADER = "x-anthropic-billing-header:"


def _system(system: object, where: str = "system") -> str | None:
    """The text of a system prompt (``system``, or a system message's ``content`` at ``where``)."""
    if system is None:
        return None
    if isinstance(system, str):
        return None if system.startswith(_BILLING_HEADER) else system
    blocks = _need(system, list, where, "a valid string or list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        block = _need(block, Mapping, f"{where}.{j}", "a valid dictionary")
        if block.get("type") != "text":
            raise BadRequest(f"{where}.{j}.type: the system prompt holds text blocks, got {json.dumps(block.get('type'))}")
        text = _text(block, f"{where}.{j}")
        if not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "\n\n".join(texts)


def chat_messages(req: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as OpenAI chat messages (validated), the system messages among
    ``messages`` folded into the system prompt after ``system``, in order."""
    raw = req.get("messages")
    if raw is None:
        raise BadRequest("messages: Field required")
    system = [_system(req.get("system"))]
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(_need(raw, list, "messages", "a valid list")):
        if isinstance(message, Mapping) and message.get("role") == "system":
            system.append(_system(message.get("content"), f"messages.{i}.content"))
        else:
            messages += _message(message, i)
    if not messages:
        raise BadRequest("messages: at least one message is required")
    prompt = "\n\n".join(text for text in system if text)
    return ([{"role": "system", "content": prompt}] if prompt else []) + messages


def _tools(req: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = _optional(req, "tools", list, "a valid list") or []
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        tool = _need(tool, Mapping, where, "a valid dictionary")
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
                raise BadRequest(f"{where}.type: Anthropic's server tool {json.dumps(kind)} is not available "
                                 "with a local model; define it as a custom tool with an input_schema")
            raise BadRequest(f"{where}.type: Input should be 'custom', got {json.dumps(kind)}")
        name = _need(tool.get("name"), str, f"{where}.name", "a valid string")
        schema = _need(tool.get("input_schema"), Mapping, f"{where}.input_schema", "a valid dictionary")
        function: dict[str, Any] = {"name": name, "parameters": dict(grammar_safe_schema(schema))}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def messages_needs(req: Mapping[str, Any]) -> set[str]:
    """The capabilities (``/api/show``'s names) a Messages request needs besides chatting, as
    Ollama checks them for its Anthropic API: ``tools`` for tools, ``vision`` for image blocks.
    (Thinking is asked for only where the model can think; see :func:`messages_upstream`.)"""
    out = set()
    if isinstance(req.get("tools"), list) and req["tools"]:
        out.add("tools")
    if has_part(req.get("messages"), "image"):
        out.add("vision")
    return out


def _tool_choice(req: Mapping[str, Any], tools: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """llama-server's ``tool_choice`` (and ``parallel_tool_calls``) and the tools to offer."""
    choice = _optional(req, "tool_choice", Mapping, "a valid dictionary")
    if choice is None:
        return {}, tools
    kind = choice.get("type")
    params: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is True:
        params["parallel_tool_calls"] = False
    if kind == "auto":
        return params | {"tool_choice": "auto"}, tools
    if kind == "none":
        return params | {"tool_choice": "none"}, tools
    if kind == "any":
        return params | {"tool_choice": "required"}, tools
    if kind == "tool":
        name = _need(choice.get("name"), str, "tool_choice.name", "a valid string")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise BadRequest(f"tool_choice.name: no tool named {json.dumps(name)} in tools")
        return params | {"tool_choice": "required"}, chosen
    raise BadRequest(f"tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', got {json.dumps(kind)}")


def _sampling(req: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        value = _optional(req, key, (int, float), "a valid number")
        if value is not None:
            out[key] = float(value)
    top_k = _optional(req, "top_k", int, "a valid integer")
    if top_k is not None:
        out["top_k"] = top_k
    return out


def _max_tokens(req: Mapping[str, Any]) -> int:
    if req.get("max_tokens") is None:
        raise BadRequest("max_tokens: Field required")
    value = _need(req["max_tokens"], int, "max_tokens", "a valid integer")
    if value < 1:
        raise BadRequest(f"max_tokens: Input should be greater than or equal to 1, got {value}")
    return int(value)


def _stop_sequences(req: Mapping[str, Any]) -> tuple[str, ...]:
    stops = _optional(req, "stop_sequences", list, "a valid list") or []
    for i, stop in enumerate(stops):
        _need(stop, str, f"stop_sequences.{i}", "a valid string")
    return tuple(s for s in stops if s)


def _thinking(req: Mapping[str, Any], capable: bool) -> dict[str, Any]:
    thinking = _optional(req, "thinking", Mapping, "a valid dictionary")
    if thinking is None or not capable:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind in ("enabled", "adaptive"):
        params: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
        budget = thinking.get("budget_tokens")
        if kind == "enabled" and budget is not None:
            params["thinking_budget_tokens"] = _need(budget, int, "thinking.budget_tokens", "a valid integer")
        return params
    raise BadRequest(f"thinking.type: Input should be 'enabled', 'disabled' or 'adaptive', got {json.dumps(kind)}")


def _prefill(messages: list[dict[str, Any]]) -> str:
    last = messages[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str) and not last.get("tool_calls"):
        return str(last["content"])
    return ""


def messages_upstream(req: Mapping[str, Any], *, chat_template: bool = True, thinking_capable: bool = False) -> MessagesUpstream:
    """The llama-server request for a ``/v1/messages`` body (see the module's docstring)."""
    req = require_object(req)
    max_tokens = _max_tokens(req)
    messages = chat_messages(req)
    stops = _stop_sequences(req)
    stream = bool(_optional(req, "stream", bool, "a valid boolean"))
    tools = _tools(req)
    choice, offered = _tool_choice(req, tools)
    sampling = _sampling(req)
    thinking = _thinking(req, thinking_capable and chat_template)
    _optional(req, "metadata", Mapping, "a valid dictionary")
    prefill = _prefill(messages)
    if not chat_template:
        # A prefill continues the transcript's last "Assistant:" turn (/completion echoes nothing).
        # Images stand where they were, as llama-server's media marker (transcript.py).
        text, media = transcript_media(messages[:-1]) if prefill else transcript_media(messages)
        prompt = media_prompt(text + f" {prefill}" if prefill else text, media)
        body: dict[str, Any] = {"prompt": prompt, "n_predict": max_tokens, "stop": [*stops, TURN_STOP],
                                "stream": True, "cache_prompt": True, "return_progress": True, **sampling}
        return MessagesUpstream(Upstream("/completion", body), turn_stop=TURN_STOP, stream=stream)
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "return_progress": True, "cache_prompt": True, **sampling, **thinking}
    if offered:
        body["tools"] = offered
        body.update(choice)
    return MessagesUpstream(Upstream("/v1/chat/completions", body), stop_sequences=stops, prefill=prefill, stream=stream)


def count_tokens_upstream(req: Mapping[str, Any], *, chat_template: bool = True, thinking_capable: bool = False) -> TokenCount:
    """What ``/v1/messages/count_tokens`` renders and counts for its body (``model``,
    ``messages``, ``system``, ``tools``, ``tool_choice``, ``thinking``; no ``max_tokens``)."""
    req = require_object(req)
    messages = chat_messages(req)
    if not chat_template:
        return TokenCount(text=transcript_prompt(messages))
    tools = _tools(req)
    choice, offered = _tool_choice(req, tools)
    body: dict[str, Any] = {"messages": messages, **_thinking(req, thinking_capable)}
    if offered:
        body["tools"] = offered
        body.update(choice)
    return TokenCount(template=body)
