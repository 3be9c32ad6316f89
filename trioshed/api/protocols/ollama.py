"""Ollama's ``/api/generate`` and ``/api/chat`` as llama-server requests, without I/O.

* :func:`generate_upstream` / :func:`chat_upstream` turn an Ollama body into the llama-server
  request to make (:class:`~trioshed.api.protocols.llama.Upstream`). Upstream is always asked to
  stream, even when the Ollama client asked ``stream: false``: the route aggregates.
* :func:`transcript_upstream`: chat with a model that has no chat template.
* :class:`~trioshed.api.protocols.ollama_stream.OllamaStream` turns llama-server's events back
  into Ollama chunks.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import time
from collections.abc import Mapping
from typing import Any, Literal

from trioshed.api.protocols.llama import (
    Upstream,
    format_params,
    logprob_params,
    think_params,
    thinking_requested,
)
from trioshed.api.protocols.options import field, json_type, require_object, split_options
from trioshed.api.protocols.transcript import (
    media_of_images,
    media_prompt,
    transcript_media,
    with_turn_stop,
)
from trioshed.core.grammar import grammar_safe_schema
from trioshed.core.media import MEDIA_MARKER
from trioshed.errors import BadRequest

Kind = Literal["generate", "chat"]

_ROLES = frozenset({"system", "user", "assistant", "tool"})

_IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def _audio_format(head: bytes) -> str | None:
    """``wav`` or ``mp3`` when the first bytes are a WAV or MP3 file's (Ollama's ``images``
    carry audio too, for models that hear), else None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _head(image: str) -> bytes:
    try:
        return base64.b64decode(image[:64] + "=" * (-len(image[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        return b""


def media_needs(images: object) -> set[str]:
    """``vision`` for images, ``audio`` for sounds among Ollama's base64 ``images``."""
    out = set()
    for image in images if isinstance(images, list) else []:
        audio = isinstance(image, str) and not image.startswith("data:") and _audio_format(_head("".join(image.split())))
        out.add("audio" if audio else "vision")
    return out


def _image_part(image: object, where: str) -> dict[str, Any]:
    """An OpenAI content part for one Ollama base64 image: ``image_url``, or ``input_audio``
    for a WAV or MP3 file."""
    if not isinstance(image, str):
        raise BadRequest(f"{where} must be base64-encoded strings, got {json_type(image)}")
    if image.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": image}}
    image = "".join(image.split())  # base64 wrapped over lines
    try:
        head = base64.b64decode(image[:64] + "=" * (-len(image[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} must be base64-encoded image data") from None
    if audio := _audio_format(head):
        return {"type": "input_audio", "input_audio": {"data": image, "format": audio}}
    mime = "image/webp" if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else None
    for magic, kind in _IMAGE_MAGIC:
        if head.startswith(magic):
            mime = kind
    return {"type": "image_url", "image_url": {"url": f"data:{mime or 'image/png'};base64,{image}"}}


def _content(text: str, images: list[Any] | None, where: str) -> str | list[dict[str, Any]]:
    """Message content: the text alone, or text and image parts when there are images."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [_image_part(image, where) for image in images]
    parts.append({"type": "text", "text": text})
    return parts


def _chat_body(
    messages: list[dict[str, Any]], sampling: dict[str, Any], req: Mapping[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": True,
        **sampling,
    }
    body.update(format_params(req.get("format"), chat=True))
    body.update(think_params(req.get("think")))
    body.update(logprob_params(req, chat=True))
    return body


def generate_upstream(req: Mapping[str, Any], *, chat_template: bool = True) -> Upstream:
    """The llama-server request for an Ollama ``/api/generate`` body.

    * ``raw: true``: ``POST /completion`` with the prompt as is (``context`` tokens, if any,
      before it) and ``cache_prompt``.
    * a model without a chat template (``chat_template=False``): the same, with ``system``
      and a blank line before the prompt, like Ollama's default template (llama-server would
      otherwise apply ChatML).
    * a ``suffix``: ``POST /infill`` (fill-in-the-middle; llama-server refuses models without
      FIM tokens, and the route reports its error).
    * otherwise: ``POST /v1/chat/completions`` with ``[system?, user: prompt]``, so that
      llama-server applies the model's own chat template; ``images`` become image parts.

    ``template`` is refused (the model's template always applies), and so is a non-empty
    ``context`` outside raw mode. Call :func:`is_load_only` first: an empty prompt is a load.
    """
    req = require_object(req)
    prompt = field(req, "prompt", str, "a string") or ""
    suffix = field(req, "suffix", str, "a string") or ""
    system = field(req, "system", str, "a string")
    raw = bool(field(req, "raw", bool, "true or false"))
    images = field(req, "images", list, "a list of base64-encoded images")
    context = field(req, "context", list, "a list of token ids") or []
    if field(req, "template", str, "a string"):
        raise BadRequest(
            '"template" is not supported: the model\'s own chat template always applies; '
            'send "raw": true with a fully formatted prompt instead'
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise BadRequest('"context" must be a list of token ids (integers)')
    sampling, runner = split_options(req.get("options"))
    media: list[str] = []
    if not raw and not suffix and not chat_template:
        # Ollama's default template, "{{ .Prompt }}", with each image's tag before the prompt
        raw = True
        if images:
            _content(prompt, images, '"images"')  # validated as for a model with a template
            media = media_of_images(images)
        prompt = f"{system}\n\n{MEDIA_MARKER * len(media)}{prompt}" if system else MEDIA_MARKER * len(media) + prompt

    if suffix or raw:
        if images and not media:
            raise BadRequest('"images" are not supported with "raw" or "suffix"; use /api/chat')
        if context and media:
            raise BadRequest('"context" cannot be sent with "images"')
        if context and not raw:
            raise BadRequest('"context" is not supported with "suffix"')
        body: dict[str, Any] = {"stream": True, "cache_prompt": True, **sampling}
        body.update(format_params(req.get("format"), chat=False))
        body.update(logprob_params(req, chat=False))
        if suffix:
            body.update({"input_prefix": prompt, "input_suffix": suffix, "prompt": ""})
            return Upstream("/infill", body, runner)
        body["prompt"] = [*context, prompt] if context else media_prompt(prompt, media)
        return Upstream("/completion", body, runner)

    if context:
        raise BadRequest(
            '"context" (token history) is only supported with "raw": true; '
            "use /api/chat with messages for a conversation"
        )
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": _content(prompt, images, '"images"')})
    return Upstream("/v1/chat/completions", _chat_body(messages, sampling, req), runner)


def _tool_call_upstream(call: object, where: str) -> dict[str, Any]:
    """An OpenAI tool call for one Ollama ``tool_calls`` entry (arguments as a JSON string)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise BadRequest(f'{where} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}')
    arguments = function.get("arguments", {})
    if not isinstance(arguments, Mapping | str):
        raise BadRequest(f"{where}.function.arguments must be an object")
    out: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
    if isinstance(call, Mapping) and isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message_upstream(message: object, i: int) -> dict[str, Any]:
    """An OpenAI chat message for one Ollama message, validated."""
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise BadRequest(f"{where} must be an object, got {json_type(message)}")
    role = message.get("role")
    if role not in _ROLES:
        raise BadRequest(
            f"{where}.role must be one of system, user, assistant, tool; got {json.dumps(role)}"
        )
    content = field(message, "content", str, "a string") or ""
    images = field(message, "images", list, "a list of base64-encoded images")
    out: dict[str, Any] = {"role": role, "content": _content(content, images, f"{where}.images")}
    thinking = field(message, "thinking", str, "a string")
    if thinking and role == "assistant":
        out["reasoning_content"] = thinking
    tool_calls = field(message, "tool_calls", list, "a list")
    if tool_calls:
        out["tool_calls"] = [
            _tool_call_upstream(call, f"{where}.tool_calls[{j}]")
            for j, call in enumerate(tool_calls)
        ]
    tool_name = field(message, "tool_name", str, "a string") or field(
        message, "name", str, "a string"
    )
    if tool_name:
        out["name"] = tool_name
    tool_call_id = field(message, "tool_call_id", str, "a string")
    if tool_call_id:
        out["tool_call_id"] = tool_call_id
    return out


def _tools_upstream(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise BadRequest(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}'
            )
        if tool.get("type", "function") != "function":
            raise BadRequest(
                f'tools[{i}].type must be "function", got {json.dumps(tool.get("type"))}'
            )
        function = dict(function)
        if "parameters" in function:  # bounds llama-server's grammar cannot hold dropped first
            function["parameters"] = grammar_safe_schema(function["parameters"])
        out.append({"type": "function", "function": function})
    return out


def chat_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for an Ollama ``/api/chat`` body: ``POST /v1/chat/completions``.

    Messages are validated (roles system/user/assistant/tool, string content, base64 images,
    tool calls) and converted to OpenAI's shape; ``format`` becomes a JSON-schema
    ``response_format``, ``think`` ``chat_template_kwargs.enable_thinking`` (or
    ``reasoning_effort`` for a level), ``tools`` pass through. A final assistant message is
    continued, as Ollama does. Call :func:`is_load_only` first: no messages is a load.
    """
    req = require_object(req)
    raw_messages = field(req, "messages", list, "a list of messages") or []
    messages = [_message_upstream(m, i) for i, m in enumerate(raw_messages)]
    if not messages:
        raise BadRequest('"messages" must not be empty')
    tools = field(req, "tools", list, "a list of tools")
    sampling, runner = split_options(req.get("options"))
    body = _chat_body(messages, sampling, req)
    if tools:
        body["tools"] = _tools_upstream(tools)
    last = messages[-1]
    prefill = (
        last["content"] if last["role"] == "assistant" and isinstance(last["content"], str) else ""
    )
    return Upstream("/v1/chat/completions", body, runner, prefill)


def is_load_only(kind: Kind | Literal["embed"], req: Mapping[str, Any]) -> bool:
    """Whether this Ollama request only loads (or, with ``keep_alive: 0``, unloads) the model.

    Ollama answers ``/api/generate`` without a prompt and ``/api/chat`` without messages with
    :func:`load_response` once the model is loaded, generating nothing; ``/api/embed`` without
    input answers ``{"model": ..., "embeddings": []}``.
    """
    req = require_object(req)
    # Types first, as Ollama decodes them: {"prompt": {}} is a 400, not an empty prompt (a load)
    if kind == "embed":
        texts = req.get("input")
        if texts is not None and not (
            isinstance(texts, str) or (isinstance(texts, list) and all(isinstance(t, str) for t in texts))
        ):
            raise BadRequest(f'"input" must be a string or a list of strings, got {json_type(texts)}')
        return not texts
    think_params(req.get("think"))
    if kind == "generate":
        return not field(req, "prompt", str, "a string") and not field(req, "suffix", str, "a string")
    return not field(req, "messages", list, "a list of messages")


def now_rfc3339() -> str:
    """The current UTC time as Ollama writes ``created_at``: RFC 3339, ``Z``, no trailing zeros."""
    return rfc3339(time.time_ns() // 1000)


@functools.lru_cache(maxsize=4)
def _spelled(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def rfc3339(micros: int) -> str:
    """``micros`` (microseconds since the epoch, UTC) as :func:`now_rfc3339` spells it. Once per
    streamed chunk on Ollama's routes: the date and time of day are spelled once a second
    (``datetime.strftime`` was ~2.5 us of the relay's per-token cost), the fraction each call."""
    second, fraction = divmod(micros, 1_000_000)
    if not fraction:
        return _spelled(second) + "Z"
    return f"{_spelled(second)}.{fraction:06d}".rstrip("0") + "Z"


def load_response(
    kind: Kind, model: str, *, done_reason: Literal["load", "unload"], created_at: str
) -> dict[str, Any]:
    """Ollama's answer to a load-only (``"load"``) or unload (``"unload"``) request."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    if kind == "generate":
        out["response"] = ""
    else:
        out["message"] = {"role": "assistant", "content": ""}
    out.update({"done": True, "done_reason": done_reason})
    return out



def with_model_system(
    kind: Kind, body: dict[str, Any], system: str, preamble: tuple[tuple[str, str], ...] = ()
) -> dict[str, Any]:
    """``body`` with the model's default system prompt (an Ollama store's ``system`` layer) where
    the request brings none, as Ollama does: ``system`` for generate, a leading system message
    for chat. A chat also gets the model's own messages (its ``messages`` layer, a Modelfile's
    ``MESSAGE`` lines) before the request's, after that system message, as Ollama sends them."""
    if kind == "generate":
        return body if not system or body.get("system") else {**body, "system": system}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return body
    first = messages[0]
    head: list[dict[str, Any]] = []
    if system and not (isinstance(first, dict) and first.get("role") == "system"):
        head.append({"role": "system", "content": system})
    head += [{"role": role, "content": content} for role, content in preamble]
    return {**body, "messages": [*head, *messages]} if head else body


def transcript_upstream(body: dict[str, Any], *, default_stop: object = None) -> Upstream:
    """Chat with a model that brings no chat template (a base model, like the demo's): a plain
    transcript it can continue, cut at the next turn, with the messages' images and sounds
    where they stand (see :mod:`.transcript`). ``default_stop``: the model's ``stop`` option,
    for a request that sets none (the transcript's own stop would hide it otherwise)."""
    chat = chat_upstream(body)  # the same validation as templated chat; images become parts
    prompt, media = transcript_media(chat.body["messages"])
    options = dict(body.get("options") or {})
    options["stop"] = with_turn_stop(options.get("stop") if options.get("stop") is not None else default_stop)
    raw = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    upstream = generate_upstream({**raw, "prompt": prompt, "raw": True, "options": options})
    if media:
        upstream.body["prompt"] = media_prompt(prompt, media)
    return upstream


#: Ollama's last /api/generate answer carries ``context``, the conversation's token ids, which a
#: client may send back to continue (deprecated in Ollama's API). trioshed keeps no token history
#: outside raw mode, so its ``context`` is empty; clients that validate the answer (the Vercel AI
#: SDK's ollama-ai-provider-v2 requires the field) accept it, and sending it back is harmless.
NO_CONTEXT: list[int] = []


def needs(kind: Kind, body: Mapping[str, Any]) -> set[str]:
    """The capabilities (``/api/show``'s names) an Ollama request needs besides generating:
    ``tools`` for chat with tools, ``thinking`` for ``think`` true or a level, ``vision`` for
    images (``audio`` for sounds sent as images), ``insert`` for a generate ``suffix`` (Ollama's
    checks)."""
    out = set()
    if thinking_requested(body.get("think")):
        out.add("thinking")
    if kind == "generate":
        out |= media_needs(body.get("images"))
        if body.get("suffix"):
            out.add("insert")
        return out
    if isinstance(body.get("tools"), list) and body["tools"]:
        out.add("tools")
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, Mapping):
            out |= media_needs(m.get("images"))
    return out
