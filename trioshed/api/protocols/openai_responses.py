"""OpenAI's Responses API (``/v1/responses``) over llama-server's chat endpoint, without I/O.

:func:`chat_request` turns a Responses body into a Chat Completions body (which the route sends
to ``/v1/chat/completions`` so that the model's chat template applies, or, for a model without
one, as a transcript to ``/v1/completions``); :func:`response_of` turns the whole answer back
into a Response object, and :class:`ResponsesStream` turns the streamed chunks into the
Responses events the ``openai`` SDK parses: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
…, ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
(then a ``function_call`` item per tool call), and ``response.completed`` (``response.incomplete``
when ``max_output_tokens`` cut the answer, ``response.failed`` on an error), each with its
``sequence_number``.

Stateless: responses are not stored, so ``previous_response_id``, ``conversation`` and
``item_reference`` inputs are refused (400); send the whole conversation in ``input``.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from trioshed.api.protocols.options import json_type
from trioshed.core.grammar import grammar_safe_schema
from trioshed.errors import BadRequest

logger = logging.getLogger(__name__)

NOT_STORED = (
    "previous_response_id is not supported: trioshed does not store responses (store is always false); "
    "send the whole conversation in input, with the function_call and function_call_output items"
)

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(part: Mapping[str, Any], where: str) -> str:
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.text must be a string")
    return text


def _content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's Responses content as Chat Completions content (text, or text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts, got {json_type(content)}")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        here = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise BadRequest(f"{here} must be an object")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text_of(part, here)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise BadRequest(f"{here}.image_url must be a URL or a data: URL (file_id needs stored files)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise BadRequest(f'{here}.type must be input_text, output_text or input_image, got {json.dumps(kind)}')
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as Chat Completions messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of input items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object, got {json_type(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise BadRequest(f"{where}.role must be user, system, developer or assistant, got {json.dumps(item.get('role'))}")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise BadRequest(f"{where} must have call_id, name and arguments (a JSON string)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}.call_id must be a string")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            if not isinstance(text, str):
                raise BadRequest(f"{where}.output must be text")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not sent back to it (as llama-server's chat drops it)
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item_reference needs stored responses; {NOT_STORED}")
        else:
            raise BadRequest(f"{where}.type must be message, function_call, function_call_output or reasoning, got {json.dumps(kind)}")
    return messages


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise BadRequest(f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            # built-in tools (web_search, custom, local_shell...) run on OpenAI's side: the model
            # here cannot call them; they are left out, so that an agent's function tools still work
            logger.warning("tools[%d]: a %r tool is not served (only function tools); left out", i, tool.get("type"))
            continue
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": {{...}}}}')
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise BadRequest(f"tools[{i}].parameters must be a JSON schema object")
        function = {"name": tool["name"], "parameters": dict(grammar_safe_schema(parameters))}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}')


def _response_format(text: object) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if text is not None and not isinstance(text, Mapping):
        raise BadRequest("text must be an object")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")  # type: ignore[union-attr]
        if not isinstance(schema, Mapping):
            raise BadRequest("text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": dict(grammar_safe_schema(schema))}}  # type: ignore[union-attr]
    raise BadRequest('text.format.type must be "text", "json_object" or "json_schema"')


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Chat Completions body (without ``model`` and ``stream``) for a Responses body."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise BadRequest(NOT_STORED)
    out: dict[str, Any] = {"messages": _messages(body)}
    for key, name in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (key == "max_output_tokens" and not isinstance(value, int)):
            raise BadRequest(f"{key} must be a number, got {json_type(value)}")
        if key == "max_output_tokens" and value < 1:
            raise BadRequest(f"max_output_tokens must be at least 1, got {value}")
        out[name] = value
    if body.get("tools") and (tools := _tools(body["tools"])):
        out["tools"] = tools
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"])
        if isinstance(body.get("parallel_tool_calls"), bool):
            out["parallel_tool_calls"] = body["parallel_tool_calls"]
    if (fmt := _response_format(body.get("text"))) is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    return out


# --------------------------------------------------------------------------------------------
# answers
# --------------------------------------------------------------------------------------------


def _usage(usage: object) -> dict[str, Any] | None:
    if not isinstance(usage, Mapping):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_text_part(text)] if status != "in_progress" else []}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content}


def _call_item(item_id: str, call: Mapping[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["call_id"], "name": call["name"],
            "arguments": call["arguments"] if status != "in_progress" else ""}  # fmt: skip


class Response:
    """The Response object's frame: what the request asked, echoed as OpenAI's API does."""

    def __init__(self, body: Mapping[str, Any], model: str, created_at: int, response_id: str | None = None) -> None:
        self.id = response_id or new_id("resp")
        self.body = body
        self.model = model
        self.created_at = created_at

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, *,
               finish_reason: str | None = None, error: dict[str, Any] | None = None, completed_at: int | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), Mapping) else {}
        fmt = text.get("format") if isinstance(text.get("format"), Mapping) else {"type": "text"}  # type: ignore[union-attr]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "completed_at": completed_at,
            "status": status, "incomplete_details": incomplete, "error": error, "model": self.model,
            "previous_response_id": None, "instructions": b.get("instructions"), "output": output,
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice") or "auto",
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False, "truncation": "disabled",
            "text": {"format": fmt}, "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "max_output_tokens": b.get("max_output_tokens"), "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
            "store": False, "background": False, "service_tier": "default", "metadata": b.get("metadata") or {},
            "usage": usage, "user": None,
        }  # fmt: skip


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_of(frame: Response, answer: Mapping[str, Any], completed_at: int) -> dict[str, Any]:
    """The whole Response for llama-server's whole chat completion (or completion) ``answer``."""
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
    message: Mapping[str, Any] = choice["message"] if isinstance(choice.get("message"), Mapping) else {}
    text = message.get("content") or choice.get("text") or ""
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    status = status_of(choice.get("finish_reason"))
    if text or not calls:
        output.append(_message_item(new_id("msg"), text, status if not calls else "completed"))
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        item = {"call_id": call.get("id") or new_id("call"), "name": function.get("name", ""), "arguments": function.get("arguments") or "{}"}
        output.append(_call_item(new_id("fc"), item, status if i == len(calls) - 1 else "completed"))
    return frame.object(status, output, _usage(answer.get("usage")), completed_at=completed_at)


class ResponsesStream:
    """llama-server's streamed chat chunks (or completion chunks, on the transcript path) as
    Responses events, as SSE bytes (one instance per request)."""

    def __init__(self, frame: Response) -> None:
        self.frame = frame
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # completed items, by output index
        self._message: dict[str, Any] | None = None  # the message item being written
        self._reasoning: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        snapshot = self.frame.object("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event("response.in_progress", response=snapshot)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, event: Mapping[str, Any]) -> bytes:
        """The events for one upstream chunk (parsed)."""
        out = b""
        if isinstance(event.get("usage"), Mapping):
            self._usage = _usage(event["usage"])
        for choice in event.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            delta: Mapping[str, Any] = choice["delta"] if isinstance(choice.get("delta"), Mapping) else {}
            if delta.get("reasoning_content"):
                out += self._reasoning_delta(delta["reasoning_content"])
            text = delta.get("content") or choice.get("text") or ""
            if text:
                out += self._text_delta(text)
            for call in delta.get("tool_calls") or []:
                self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
        return out

    def _reasoning_delta(self, text: str) -> bytes:
        out = b""
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "index": len(self._output), "text": ""}
            self._output.append({})
            out += self._event("response.output_item.added", output_index=self._reasoning["index"], item=_reasoning_item(self._reasoning["id"], ""))
        self._reasoning["text"] += text
        r = self._reasoning
        return out + self._event("response.reasoning_text.delta", item_id=r["id"], output_index=r["index"], content_index=0, delta=text)

    def _close_reasoning(self) -> bytes:
        r, self._reasoning = self._reasoning, None
        if r is None or r.get("closed"):
            return b""
        item = _reasoning_item(r["id"], r["text"])
        self._output[r["index"]] = item
        return (self._event("response.reasoning_text.done", item_id=r["id"], output_index=r["index"], content_index=0, text=r["text"])
                + self._event("response.output_item.done", output_index=r["index"], item=item))  # fmt: skip

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._message is None:
            out += self._close_reasoning()
            self._message = {"id": new_id("msg"), "index": len(self._output), "text": ""}
            self._output.append({})
            m = self._message
            out += self._event("response.output_item.added", output_index=m["index"], item=_message_item(m["id"], "", "in_progress"))
            out += self._event("response.content_part.added", item_id=m["id"], output_index=m["index"], content_index=0, part=_text_part(""))
        m = self._message
        m["text"] += text
        return out + self._event("response.output_text.delta", item_id=m["id"], output_index=m["index"], content_index=0, delta=text, logprobs=[])

    def _call_delta(self, call: Mapping[str, Any]) -> None:
        slot = self._calls.setdefault(int(call.get("index", len(self._calls))), {"call_id": "", "name": "", "arguments": ""})
        if call.get("id"):
            slot["call_id"] = call["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def finish(self, completed_at: int) -> bytes:
        """The closing events: the message item done, a ``function_call`` item per tool call, and
        ``response.completed`` (``response.incomplete`` when the length limit cut the answer, and
        the item it cut ``incomplete``)."""
        out = self._close_reasoning()
        if self._message is None and not self._calls:
            self._message = {"id": new_id("msg"), "index": len(self._output), "text": ""}
            self._output.append({})
            m = self._message
            out += self._event("response.output_item.added", output_index=m["index"], item=_message_item(m["id"], "", "in_progress"))
            out += self._event("response.content_part.added", item_id=m["id"], output_index=m["index"], content_index=0, part=_text_part(""))
        status = status_of(self.finish_reason)
        if self._message is not None:
            m = self._message
            # the item the length limit cut is incomplete, as OpenAI's API marks it: the answer's
            # last (the text, or the last tool call after it)
            item = _message_item(m["id"], m["text"], status if not self._calls else "completed")
            self._output[m["index"]] = item
            out += self._event("response.output_text.done", item_id=m["id"], output_index=m["index"], content_index=0, text=m["text"], logprobs=[])
            out += self._event("response.content_part.done", item_id=m["id"], output_index=m["index"], content_index=0, part=_text_part(m["text"]))
            out += self._event("response.output_item.done", output_index=m["index"], item=item)
        calls = sorted(self._calls.items())
        for n, (_, call) in enumerate(calls):
            call["call_id"] = call["call_id"] or new_id("call")
            call["arguments"] = call["arguments"] or "{}"
            item_id, index = new_id("fc"), len(self._output)
            self._output.append(_call_item(item_id, call, status if n == len(calls) - 1 else "completed"))
            out += self._event("response.output_item.added", output_index=index, item=_call_item(item_id, call, "in_progress"))
            out += self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=call["arguments"])
            out += self._event("response.function_call_arguments.done", item_id=item_id, output_index=index, name=call["name"], arguments=call["arguments"])
            out += self._event("response.output_item.done", output_index=index, item=self._output[index])
        final = self.frame.object(status, self._output, self._usage, completed_at=completed_at)
        return out + self._event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def failed(self, code: str, message: str) -> bytes:
        """``response.failed``, for an error after the stream started."""
        error = {"code": code, "message": message}
        return self._event("response.failed", response=self.frame.object("failed", [i for i in self._output if i], self._usage, error=error))
