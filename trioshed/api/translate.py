"""Pure translation between Ollama's API and llama-server's HTTP API.

No I/O, no trio: the routes hand these functions parsed JSON and get back what to send.

* :func:`split_options` turns Ollama ``options`` into llama-server sampling parameters and the
  runner overrides (``num_ctx``...) that choose or size a runner.
* :func:`generate_upstream` / :func:`chat_upstream` turn an Ollama ``/api/generate`` or
  ``/api/chat`` body into the llama-server request to make (:class:`Upstream`). Upstream is always
  asked to stream, even when the Ollama client asked ``stream: false``: the route aggregates.
* :class:`OllamaStream` turns llama-server's streamed events (``/completion``, ``/infill`` and
  ``/v1/chat/completions`` alike; it tells them apart by shape) into Ollama NDJSON chunks, the
  final ``done`` chunk, or one aggregated response.
* :func:`parse_sse_line` reads one line of llama-server's event stream.

Upstream facts this relies on (recorded from a real llama-server, see ``tests/test_translate.py``):

* Streams are SSE ``data: {...}`` lines separated by blank lines; ``/v1/chat/completions`` ends
  with ``data: [DONE]``, ``/completion`` just closes. A keep-alive ping is a ``:`` comment. An
  error after the first event arrives as ``data: {"error": {"code", "message", "type"}}``; an
  error before it is an ordinary non-200 response.
* ``/completion``'s last event has ``"stop": true``, ``stop_type`` (``"eos"``, ``"word"``,
  ``"limit"``), ``tokens_evaluated`` (the whole prompt) and ``timings``.
* ``/v1/chat/completions``'s chunk with a non-null ``finish_reason`` (``"stop"``, ``"length"``,
  ``"tool_calls"``) has an empty delta; with ``stream_options.include_usage`` one more chunk with
  ``choices: []`` carries ``usage``; the last chunk carries ``timings``.
* ``timings``: ``cache_n``, ``prompt_n`` (prompt tokens evaluated now, cache excluded),
  ``prompt_ms``, ``predicted_n``, ``predicted_ms`` (and per-token/per-second figures).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from trioshed.api.limits import check_num_predict
from trioshed.errors import BadRequest, UpstreamError

__all__ = [
    "IGNORED_OPTION_KEYS",
    "RUNNER_OPTION_KEYS",
    "SAMPLING_OPTION_NAMES",
    "Kind",
    "ModelRenamer",
    "OllamaStream",
    "Upstream",
    "chat_upstream",
    "embed_response",
    "embed_upstream",
    "embeddings_response",
    "embeddings_upstream",
    "generate_upstream",
    "is_load_only",
    "load_response",
    "now_rfc3339",
    "openai_model_rewrite",
    "parse_sse_line",
    "split_options",
    "upstream_error_message",
]

logger = logging.getLogger(__name__)

Kind = Literal["generate", "chat"]

# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------

_INT, _FLOAT, _BOOL, _STOP = "int", "float", "bool", "stop"

#: Ollama sampling option -> (llama-server parameter, value kind).
_SAMPLING: dict[str, tuple[str, str]] = {
    "num_predict": ("n_predict", _INT),
    "temperature": ("temperature", _FLOAT),
    "top_k": ("top_k", _INT),
    "top_p": ("top_p", _FLOAT),
    "min_p": ("min_p", _FLOAT),
    "typical_p": ("typical_p", _FLOAT),
    "seed": ("seed", _INT),
    "stop": ("stop", _STOP),
    "repeat_penalty": ("repeat_penalty", _FLOAT),
    "repeat_last_n": ("repeat_last_n", _INT),
    "presence_penalty": ("presence_penalty", _FLOAT),
    "frequency_penalty": ("frequency_penalty", _FLOAT),
    "num_keep": ("n_keep", _INT),
    "mirostat": ("mirostat", _INT),
    "mirostat_tau": ("mirostat_tau", _FLOAT),
    "mirostat_eta": ("mirostat_eta", _FLOAT),
}
SAMPLING_OPTION_NAMES: Mapping[str, str] = {k: v[0] for k, v in _SAMPLING.items()}

#: Options that choose or size a runner (a different value may need a different runner).
_RUNNER: dict[str, str] = {
    "num_ctx": _INT,
    "num_batch": _INT,
    "num_gpu": _INT,
    "main_gpu": _INT,
    "use_mmap": _BOOL,
    "num_thread": _INT,
}
RUNNER_OPTION_KEYS: frozenset[str] = frozenset(_RUNNER)

#: Options Ollama accepts that mean nothing to llama-server: accepted and dropped, silently.
IGNORED_OPTION_KEYS: frozenset[str] = frozenset(
    {
        "penalize_newline",
        "tfs_z",
        "numa",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mlock",
        "embedding_only",
    }
)

_KIND_WORDS = {
    _INT: "an integer",
    _FLOAT: "a number",
    _BOOL: "true or false",
    _STOP: "a string or a list of strings",
}


def _json_type(value: object) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _check_option(key: str, value: Any, kind: str) -> Any:
    """``value`` converted to ``kind``, or :class:`BadRequest` naming the option."""
    ok = True
    if kind == _INT:
        if isinstance(value, float) and math.isfinite(value):
            value = int(value)  # 5.0 from JSON clients; 1.5 truncated toward zero, as Ollama's FromMap does
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == _FLOAT:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif kind == _BOOL:
        ok = isinstance(value, bool)
    elif kind == _STOP:
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list | tuple) and all(isinstance(s, str) for s in value)
        value = list(value) if ok else value
    if not ok:
        raise BadRequest(
            f'option "{key}" must be {_KIND_WORDS[kind]}, got {_json_type(value)} '
            f"{json.dumps(value, default=repr)}"
        )
    return value


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Ollama ``options`` into (llama-server sampling parameters, runner overrides).

    Sampling options are renamed to llama-server's names (``num_predict`` -> ``n_predict``,
    ``num_keep`` -> ``n_keep``; a negative ``num_predict``, Ollama's "no limit" -1 or "fill the
    context" -2, becomes -1). Runner overrides keep Ollama's names (:data:`RUNNER_OPTION_KEYS`).
    ``null`` values count as absent. Unknown keys are ignored with a warning, as Ollama does;
    a value of the wrong type is a :class:`BadRequest` naming the option.
    """
    if options is None:
        return {}, {}
    if not isinstance(options, Mapping):
        raise BadRequest(f'"options" must be an object, got {_json_type(options)}')
    sampling: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in _SAMPLING:
            name, kind = _SAMPLING[key]
            value = _check_option(key, value, kind)
            if key == "num_predict":
                check_num_predict(value)
            if key == "num_predict" and value < 0:
                value = -1
            sampling[name] = value
        elif key in _RUNNER:
            runner[key] = _check_option(key, value, _RUNNER[key])
        elif key not in IGNORED_OPTION_KEYS:
            logger.warning("invalid option provided: %r (ignored)", key)
    return sampling, runner


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """The llama-server request for one Ollama request: ``POST path`` with JSON ``body``.

    ``runner_options`` are the request's runner overrides (``num_ctx``...) from
    :func:`split_options`, for the scheduler; they are not part of the body.
    """

    path: str
    body: dict[str, Any]
    runner_options: dict[str, Any] = field(default_factory=dict)
    #: The content of a final assistant message that llama-server continues; it echoes that
    #: text at the start of its stream, and ``OllamaStream(prefill=...)`` strips it again.
    prefill: str = ""

    def with_defaults(self, sampling: Mapping[str, Any]) -> Upstream:
        """This request with ``sampling`` parameters (a model's defaults) under the request's own."""
        return replace(self, body={**sampling, **self.body})


_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _field(req: Mapping[str, Any], key: str, types: type | tuple[type, ...], words: str) -> Any:
    """``req[key]`` if present and of ``types`` (``None`` if absent or null), else BadRequest."""
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise BadRequest(f'"{key}" must be {words}, got {_json_type(value)}')
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _require_object(req: object) -> Mapping[str, Any]:
    if not isinstance(req, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(req)}")
    return req


_IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def _image_part(image: object, where: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part for one Ollama base64 image."""
    if not isinstance(image, str):
        raise BadRequest(f"{where} must be base64-encoded strings, got {_json_type(image)}")
    if image.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": image}}
    image = "".join(image.split())  # base64 wrapped over lines
    try:
        head = base64.b64decode(image[:64] + "=" * (-len(image[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} must be base64-encoded image data") from None
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


def _format_params(fmt: object, *, chat: bool) -> dict[str, Any]:
    """llama-server parameters for Ollama's ``format`` (``"json"`` or a JSON schema)."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        schema: dict[str, Any] = {"type": "object"}
    elif isinstance(fmt, Mapping):
        schema = dict(fmt)
    else:
        raise BadRequest(f'"format" must be "json" or a JSON schema object, got {json.dumps(fmt)}')
    if chat:
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    return {"json_schema": schema}


def _think_params(think: object) -> dict[str, Any]:
    """llama-server parameters for Ollama's ``think`` (a bool, or a level such as ``"high"``)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if isinstance(think, str) and think in {"low", "medium", "high"}:
        return {"reasoning_effort": think}
    raise BadRequest(
        f'"think" must be true, false, "low", "medium" or "high", got {json.dumps(think)}'
    )


def _logprob_params(req: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    logprobs = _field(req, "logprobs", bool, "true or false")
    top = _field(req, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= 20:
        raise BadRequest(f'"top_logprobs" must be between 0 and 20, got {top}')
    if not logprobs:
        if top:
            raise BadRequest('"top_logprobs" requires "logprobs": true')
        return {}
    # llama-server reports no logprobs at all when asked for 0 alternatives: ask for at least 1
    if chat:
        return {"logprobs": True, "top_logprobs": max(top or 0, 1)}
    return {"n_probs": max(top or 0, 1), "post_sampling_probs": False}


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
    body.update(_format_params(req.get("format"), chat=True))
    body.update(_think_params(req.get("think")))
    body.update(_logprob_params(req, chat=True))
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
    req = _require_object(req)
    prompt = _field(req, "prompt", str, "a string") or ""
    suffix = _field(req, "suffix", str, "a string") or ""
    system = _field(req, "system", str, "a string")
    raw = bool(_field(req, "raw", bool, "true or false"))
    images = _field(req, "images", list, "a list of base64-encoded images")
    context = _field(req, "context", list, "a list of token ids") or []
    if _field(req, "template", str, "a string"):
        raise BadRequest(
            '"template" is not supported: the model\'s own chat template always applies; '
            'send "raw": true with a fully formatted prompt instead'
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise BadRequest('"context" must be a list of token ids (integers)')
    sampling, runner = split_options(req.get("options"))
    if not raw and not suffix and not chat_template:
        raw = True
        prompt = f"{system}\n\n{prompt}" if system else prompt

    if suffix or raw:
        if images:
            raise BadRequest('"images" are not supported with "raw" or "suffix"; use /api/chat')
        if context and not raw:
            raise BadRequest('"context" is not supported with "suffix"')
        body: dict[str, Any] = {"stream": True, "cache_prompt": True, **sampling}
        body.update(_format_params(req.get("format"), chat=False))
        body.update(_logprob_params(req, chat=False))
        if suffix:
            body.update({"input_prefix": prompt, "input_suffix": suffix, "prompt": ""})
            return Upstream("/infill", body, runner)
        body["prompt"] = [*context, prompt] if context else prompt
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
        raise BadRequest(f"{where} must be an object, got {_json_type(message)}")
    role = message.get("role")
    if role not in _ROLES:
        raise BadRequest(
            f"{where}.role must be one of system, user, assistant, tool; got {json.dumps(role)}"
        )
    content = _field(message, "content", str, "a string") or ""
    images = _field(message, "images", list, "a list of base64-encoded images")
    out: dict[str, Any] = {"role": role, "content": _content(content, images, f"{where}.images")}
    thinking = _field(message, "thinking", str, "a string")
    if thinking and role == "assistant":
        out["reasoning_content"] = thinking
    tool_calls = _field(message, "tool_calls", list, "a list")
    if tool_calls:
        out["tool_calls"] = [
            _tool_call_upstream(call, f"{where}.tool_calls[{j}]")
            for j, call in enumerate(tool_calls)
        ]
    tool_name = _field(message, "tool_name", str, "a string") or _field(
        message, "name", str, "a string"
    )
    if tool_name:
        out["name"] = tool_name
    tool_call_id = _field(message, "tool_call_id", str, "a string")
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
        out.append({"type": "function", "function": dict(function)})
    return out


def chat_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for an Ollama ``/api/chat`` body: ``POST /v1/chat/completions``.

    Messages are validated (roles system/user/assistant/tool, string content, base64 images,
    tool calls) and converted to OpenAI's shape; ``format`` becomes a JSON-schema
    ``response_format``, ``think`` ``chat_template_kwargs.enable_thinking`` (or
    ``reasoning_effort`` for a level), ``tools`` pass through. A final assistant message is
    continued, as Ollama does. Call :func:`is_load_only` first: no messages is a load.
    """
    req = _require_object(req)
    raw_messages = _field(req, "messages", list, "a list of messages") or []
    messages = [_message_upstream(m, i) for i, m in enumerate(raw_messages)]
    if not messages:
        raise BadRequest('"messages" must not be empty')
    tools = _field(req, "tools", list, "a list of tools")
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
    req = _require_object(req)
    if kind == "generate":
        return not req.get("prompt") and not req.get("suffix")
    if kind == "embed":
        return not req.get("input")
    return not req.get("messages")


# --------------------------------------------------------------------------------------------
# embeddings
# --------------------------------------------------------------------------------------------
# llama-server serves /v1/embeddings only when started with --embeddings and a pooling type
# other than none (a generative GGUF such as gemma3 defaults to none: "Pooling type 'none' is
# not OAI compatible"); it answers L2-normalized vectors, or raw ones with embd_normalize -1,
# and fails an input longer than the physical batch (-ub) rather than truncating it.


def embed_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for an Ollama ``/api/embed`` body (``input``: text or texts).

    ``POST /v1/embeddings``; Ollama's ``truncate`` cannot be honoured (llama-server refuses an
    over-long input either way). Call :func:`is_load_only` first: no input is a load.
    """
    req = _require_object(req)
    texts = req.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest('"input" must be a string or a list of strings')
    if not texts:
        raise BadRequest('"input" must not be empty')
    dimensions = _field(req, "dimensions", int, "an integer")
    if dimensions is not None and dimensions < 1:
        raise BadRequest(f'"dimensions" must be a positive integer, got {dimensions}')
    _field(req, "truncate", bool, "true or false")
    _, runner = split_options(req.get("options"))
    return Upstream("/v1/embeddings", {"input": texts, "encoding_format": "float"}, runner)


def embeddings_upstream(req: Mapping[str, Any]) -> Upstream:
    """The llama-server request for Ollama's older ``/api/embeddings`` (``prompt``; raw vector)."""
    req = _require_object(req)
    prompt = _field(req, "prompt", str, "a string") or ""
    _, runner = split_options(req.get("options"))
    body = {"input": [prompt], "encoding_format": "float", "embd_normalize": -1}
    return Upstream("/v1/embeddings", body, runner)


def _vectors(response: Mapping[str, Any]) -> list[list[float]]:
    """The embedding vectors of a ``/v1/embeddings`` answer, in input order."""
    data = response.get("data")
    if not isinstance(data, list) or not all(
        isinstance(d, Mapping) and isinstance(d.get("embedding"), list) for d in data
    ):
        raise UpstreamError(
            f"llama-server sent an unexpected embeddings answer: {str(response)[:200]}"
        )
    return [list(d["embedding"]) for d in sorted(data, key=lambda d: d.get("index", 0))]


def embed_response(
    response: Mapping[str, Any],
    model: str,
    *,
    dimensions: int | None = None,
    load_duration_ns: int,
    total_duration_ns: int,
) -> dict[str, Any]:
    """Ollama's ``/api/embed`` answer for llama-server's ``/v1/embeddings`` answer.

    With ``dimensions``, each vector is cut to that length and normalized again, as Ollama does.
    """
    vectors = _vectors(response)
    if dimensions:
        vectors = [_normalized(v[:dimensions]) for v in vectors]
    usage = response.get("usage")
    prompt_tokens = usage.get("prompt_tokens", 0) if isinstance(usage, Mapping) else 0
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": int(total_duration_ns),
        "load_duration": int(load_duration_ns),
        "prompt_eval_count": int(prompt_tokens),
    }


def embeddings_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's ``/api/embeddings`` answer: ``{"embedding": [...]}``."""
    vectors = _vectors(response)
    return {"embedding": vectors[0] if vectors else []}


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def now_rfc3339() -> str:
    """The current UTC time as Ollama writes ``created_at``: RFC 3339, ``Z``, no trailing zeros."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f").rstrip("0").rstrip(".")
    return stamp + "Z"


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


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------


def parse_sse_line(line: bytes | str) -> dict[str, Any] | None:
    """One line of a llama-server stream as a JSON object, or ``None`` for nothing to translate.

    ``data: {...}`` gives the object; ``data: [DONE]``, blank lines, ``:`` comments (llama-
    server's keep-alive pings) and other SSE fields (``event:``, ``id:``) give ``None``. A bare
    JSON line (NDJSON) is accepted too. Trailing ``\\r``/``\\n`` are ignored. Malformed JSON
    raises :class:`UpstreamError`. (llama-server never splits an event over several ``data:``
    lines, so lines are read one at a time.)
    """
    if isinstance(line, bytes | bytearray):
        if line.startswith(b"data: {"):  # llama-server's events: parse the bytes as they are
            return _event(bytes(line[6:]))
        line = bytes(line).decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    if line.startswith("data:"):
        payload = line[5:].removeprefix(" ")
    elif line.startswith("error:"):  # older llama-server builds
        payload = '{"error": ' + line[6:].strip() + "}"
    elif line.lstrip().startswith("{"):
        payload = line
    else:
        return None
    if payload.strip() == "[DONE]":
        return None
    return _event(payload)


def _event(payload: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError:
        raise UpstreamError(
            f"llama-server sent malformed JSON in its stream: {payload[:200]!r}"
        ) from None
    if not isinstance(event, dict):
        raise UpstreamError(f"llama-server sent a non-object event: {payload[:200]!r}")
    return event


def upstream_error_message(event: Mapping[str, Any]) -> str:
    """The message of a llama-server error object (``{"error": {"message": ...}}`` or a string)."""
    error = event.get("error", event)
    if isinstance(error, Mapping):
        return str(error.get("message") or json.dumps(error))
    return str(error)


def openai_model_rewrite(chunk: dict[str, Any], model: str) -> dict[str, Any]:
    """``chunk`` (an OpenAI-shaped llama-server response) with ``model`` set to trioshed's name.

    llama-server reports its GGUF file name (or ``--alias``); clients must see the name they
    asked for. Returns a new dict; chunks without ``model`` (errors) come back unchanged.
    """
    if "model" not in chunk:
        return chunk
    return {**chunk, "model": model}


class ModelRenamer:
    """llama-server's SSE bytes for the client, unchanged except ``"model"`` named as the client did.

    Pass-through for OpenAI routes: no event is parsed. Every llama-server chunk carries
    ``"model":"<alias>"`` (the runner is started with ``--alias`` = trioshed's model name, and
    serializes without spaces); inside a JSON string a quote is escaped, so those bytes can only be
    the field itself, and one ``bytes.replace`` per batch renames it. Only complete lines are
    passed on (a batch may end inside an event; the rest waits for the next one). Should the
    field not read as expected, the first event that names a model is parsed to learn it, and
    if that fails too every event is parsed and rewritten (correct, slower).
    """

    def __init__(self, upstream_name: str, client_name: str) -> None:
        self._needle = self._field(upstream_name)
        self._replacement = self._field(client_name)
        self._checked = upstream_name == client_name  # nothing to rename: never look
        self._slow = False
        self._client_name = client_name
        self._rest = b""

    @staticmethod
    def _field(name: str) -> bytes:
        return b'"model":' + json.dumps(name, ensure_ascii=False).encode()

    def feed(self, data: bytes) -> bytes:
        """The bytes to send now for ``data`` (complete lines only)."""
        data = self._rest + data
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        return self._rename(data[:cut]) if cut else b""

    def finish(self) -> bytes:
        """Whatever is left (a last line without its newline)."""
        rest, self._rest = self._rest, b""
        return self._rename(rest) if rest else b""

    def _rename(self, data: bytes) -> bytes:
        if not self._checked:
            self._learn(data)
        if self._slow:
            return b"".join(self._rewrite_line(line) for line in data.splitlines(keepends=True))
        if self._needle == self._replacement:
            return data
        return data.replace(self._needle, self._replacement)

    def _learn(self, data: bytes) -> None:
        for line in data.splitlines():
            if b'"model":' not in line or not line.startswith(b"data:"):
                continue
            self._checked = True
            if self._needle in line:
                return
            event = parse_sse_line(line)
            actual = event.get("model") if event else None
            if isinstance(actual, str) and self._field(actual) in line:
                self._needle = self._field(actual)
            else:
                self._slow = True
            return

    def _rewrite_line(self, line: bytes) -> bytes:
        event = parse_sse_line(line) if line.startswith(b"data:") else None
        if event is None or "model" not in event:
            return line
        return b"data: " + json.dumps(openai_model_rewrite(event, self._client_name)).encode() + b"\n"


_DONE_REASONS = {"eos": "stop", "word": "stop", "limit": "length", "length": "length"}


class OllamaStream:
    """Stateful translator of one llama-server stream into Ollama chunks (one per request).

    Feed it each upstream event (:func:`parse_sse_line`'s objects) in order; :meth:`feed`
    returns the Ollama chunks to send now. Then :meth:`finish` gives the final ``done`` chunk,
    or, for ``stream: false``, :meth:`aggregate` the single response. The upstream kind is read
    from each event's shape, so a generate request served by ``/v1/chat/completions`` works.

    Tool calls arrive in pieces (OpenAI's streamed ``arguments`` fragments) and are sent whole,
    as Ollama does, in one chunk when upstream reports the finish reason.
    """

    def __init__(
        self,
        kind: Kind,
        model: str,
        *,
        created_at_fn: Callable[[], str] = now_rfc3339,
        prefill: str = "",
    ) -> None:
        if kind not in ("generate", "chat"):
            raise ValueError(f"kind must be 'generate' or 'chat', not {kind!r}")
        self.kind: Kind = kind
        self.model = model
        self._created_at = created_at_fn
        self._stamp: str | None = None  # one created_at for the chunks of a batch
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._tool_calls_sent = False
        self._logprobs: list[dict[str, Any]] = []
        self._done_reason: str | None = None
        self._timings: Mapping[str, Any] = {}
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        self._pieces = 0
        self._echo = prefill  # what is left to strip of llama-server's echo of the prefill

    @property
    def finished(self) -> bool:
        """Whether upstream reported the end of generation (a stop type or finish reason).

        A stream that closes before this is a truncated one (the runner died or was stopped).
        """
        return self._done_reason is not None

    @property
    def text(self) -> str:
        """The content generated so far."""
        return "".join(self._text)

    # -- feeding ------------------------------------------------------------------------------

    def feed_lines(self, lines: Iterable[bytes | str]) -> list[dict[str, Any]]:
        """The Ollama chunks for a batch of upstream stream lines (what one socket read held).

        The chunks of one batch share their ``created_at``: they arrived together.
        """
        self._stamp = self._created_at()
        try:
            return [chunk for line in lines if (event := parse_sse_line(line)) is not None for chunk in self.feed(event)]
        finally:
            self._stamp = None

    def feed(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The Ollama chunks for one upstream event (often one, possibly none).

        Raises :class:`UpstreamError` for an upstream error event.
        """
        if "error" in event:
            raise UpstreamError(f"llama-server error: {upstream_error_message(event)}")
        if "choices" in event:
            return self._feed_openai(event)
        return self._feed_completion(event)

    def _feed_completion(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        content = event.get("content") or ""
        probs = event.get("completion_probabilities") or []
        logprobs = [_logprob_from_completion(p) for p in probs if isinstance(p, Mapping)]
        if content or logprobs:
            out.append(self._piece(content=content, logprobs=logprobs))
        if event.get("stop"):
            self._done_reason = _DONE_REASONS.get(str(event.get("stop_type")), "stop")
            self._timings = event.get("timings") or self._timings
            if isinstance(event.get("tokens_evaluated"), int):
                self._prompt_tokens = event["tokens_evaluated"]
            if isinstance(event.get("tokens_predicted"), int):
                self._completion_tokens = event["tokens_predicted"]
        return out

    def _feed_openai(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        if isinstance(event.get("timings"), Mapping):
            self._timings = event["timings"]
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
            self._completion_tokens = usage.get("completion_tokens", self._completion_tokens)
        for choice in event.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            content = self._strip_echo(delta.get("content") or choice.get("text") or "")
            thinking = delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                self._add_tool_call_delta(call)
            lp = choice.get("logprobs")
            logprobs = [
                _logprob_from_openai(p)
                for p in ((lp.get("content") or []) if isinstance(lp, Mapping) else [])
                if isinstance(p, Mapping)
            ]
            if content or thinking or logprobs:
                out.append(self._piece(content=content, thinking=thinking, logprobs=logprobs))
            reason = choice.get("finish_reason")
            if reason is not None:
                self._done_reason = _DONE_REASONS.get(str(reason), "stop")
                if self._tool_calls and not self._tool_calls_sent:
                    out.append(self._tool_call_chunk())
        return out

    def _strip_echo(self, content: str) -> str:
        """``content`` less llama-server's echo of a continued assistant message.

        Continuing a final assistant message, llama-server's first content delta repeats that
        message (``"1, 2, 3,"`` continued gives ``"1, 2, 3, "``, ``"4"``, ...); Ollama sends only
        the new text. Stripping stops at the first piece that does not match.
        """
        if not self._echo or not content:
            return content
        if content.startswith(self._echo):
            content, self._echo = content[len(self._echo) :], ""
        elif self._echo.startswith(content):
            content, self._echo = "", self._echo[len(content) :]
        else:
            self._echo = ""
        return content

    def _add_tool_call_delta(self, call: Mapping[str, Any]) -> None:
        index = call.get("index", len(self._tool_calls))
        slot = self._tool_calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def _ollama_tool_calls(self) -> list[dict[str, Any]]:
        calls = []
        for _, slot in sorted(self._tool_calls.items()):
            try:
                arguments = json.loads(slot["arguments"]) if slot["arguments"].strip() else {}
            except ValueError:
                raise UpstreamError(
                    f"the model called tool {slot['name']!r} with arguments that are not JSON: "
                    f"{slot['arguments'][:200]!r}"
                ) from None
            function: dict[str, Any] = {"name": slot["name"], "arguments": arguments}
            call: dict[str, Any] = {"function": function}
            if slot["id"]:
                call["id"] = slot["id"]
            calls.append(call)
        return calls

    def _tool_call_chunk(self) -> dict[str, Any]:
        self._tool_calls_sent = True
        chunk = self._head()
        chunk["message"] = {
            "role": "assistant",
            "content": "",
            "tool_calls": self._ollama_tool_calls(),
        }
        chunk["done"] = False
        return chunk

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": self._stamp or self._created_at()}

    def _piece(
        self, *, content: str, thinking: str = "", logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        self._pieces += 1
        self._text.append(content)
        if thinking:
            self._thinking.append(thinking)
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = content
            if thinking:
                chunk["thinking"] = thinking
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            chunk["message"] = message
        chunk["done"] = False
        if logprobs:
            self._logprobs.extend(logprobs)
            chunk["logprobs"] = logprobs
        return chunk

    # -- the end ------------------------------------------------------------------------------

    def _metrics(self, load_duration_ns: int, total_duration_ns: int) -> dict[str, Any]:
        t = self._timings
        cache_n = int(t.get("cache_n") or 0)
        prompt_n = int(t.get("prompt_n") or 0)
        prompt_count = (
            self._prompt_tokens if self._prompt_tokens is not None else prompt_n + cache_n
        )
        eval_count = t.get("predicted_n")
        if eval_count is None:
            eval_count = (
                self._completion_tokens if self._completion_tokens is not None else self._pieces
            )
        return {
            "total_duration": int(total_duration_ns),
            "load_duration": int(load_duration_ns),
            "prompt_eval_count": int(prompt_count),
            "prompt_eval_duration": round(float(t.get("prompt_ms") or 0.0) * 1_000_000),
            "eval_count": int(eval_count),
            "eval_duration": round(float(t.get("predicted_ms") or 0.0) * 1_000_000),
        }

    def finish(
        self, *, load_duration_ns: int, total_duration_ns: int, done_reason: str | None = None
    ) -> dict[str, Any]:
        """The final Ollama chunk: ``done: true``, ``done_reason`` and the metrics (ns).

        ``done_reason`` overrides what upstream reported (``"stop"`` or ``"length"``; ``"stop"``
        if it reported nothing). ``prompt_eval_count`` is the whole prompt, cached tokens
        included (like OpenAI's ``prompt_tokens``); ``prompt_eval_duration`` is the time spent
        on the tokens actually evaluated. Tool calls not yet sent go in this chunk's message.
        """
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = ""
        else:
            message: dict[str, Any] = {"role": "assistant", "content": ""}
            if self._tool_calls and not self._tool_calls_sent:
                self._tool_calls_sent = True
                message["tool_calls"] = self._ollama_tool_calls()
            chunk["message"] = message
        chunk["done"] = True
        chunk["done_reason"] = done_reason or self._done_reason or "stop"
        chunk.update(self._metrics(load_duration_ns, total_duration_ns))
        return chunk

    def aggregate(
        self, *, load_duration_ns: int, total_duration_ns: int, done_reason: str | None = None
    ) -> dict[str, Any]:
        """The whole response as one Ollama object, for ``stream: false``.

        Call after feeding every event; the text, thinking, tool calls and logprobs gathered,
        plus :meth:`finish`'s fields.
        """
        chunk = self._head()
        if self.kind == "generate":
            chunk["response"] = self.text
            if self._thinking:
                chunk["thinking"] = "".join(self._thinking)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self._thinking:
                message["thinking"] = "".join(self._thinking)
            if self._tool_calls:
                message["tool_calls"] = self._ollama_tool_calls()
            chunk["message"] = message
        chunk["done"] = True
        chunk["done_reason"] = done_reason or self._done_reason or "stop"
        chunk.update(self._metrics(load_duration_ns, total_duration_ns))
        if self._logprobs:
            chunk["logprobs"] = list(self._logprobs)
        return chunk


def _logprob_from_openai(p: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's logprob entry for one OpenAI ``logprobs.content`` entry."""
    out: dict[str, Any] = {
        "token": str(p.get("token", "")),
        "logprob": float(p.get("logprob", 0.0)),
    }
    top = p.get("top_logprobs")
    if top:
        out["top_logprobs"] = [
            {"token": str(t.get("token", "")), "logprob": float(t.get("logprob", 0.0))}
            for t in top
            if isinstance(t, Mapping)
        ]
    return out


def _logprob_from_completion(p: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's logprob entry for one ``/completion`` ``completion_probabilities`` entry."""
    return _logprob_from_openai(p)
