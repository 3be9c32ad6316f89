"""``GET /openapi.json``: an OpenAPI 3.1 document of every route trioshed serves.

Written by hand, from what the routes accept and answer; ``tests/api/test_openapi.py`` keeps it true
(every url rule and method of the app is documented and nothing else is; the document is valid
OpenAPI 3.1). Request schemas say what a client may send, with the constraints the routes check
(``model`` a string, ``options`` an object, ``messages`` an array of messages); fields the
routes pass through or ignore stay allowed (``additionalProperties``), as Ollama's API does.
"""

from __future__ import annotations

import functools

from quart import Blueprint, current_app

from trioshed import __version__
from trioshed.api.openapi import audio, llama, rerank
from trioshed.api.openapi.keys import keys_paths
from trioshed.api.openapi.parts import BOOL as _BOOL
from trioshed.api.openapi.parts import INT as _INT
from trioshed.api.openapi.parts import NUM as _NUM
from trioshed.api.openapi.parts import STR as _STR
from trioshed.api.openapi.parts import Schema
from trioshed.api.openapi.parts import obj as _obj
from trioshed.api.openapi.parts import ref as _ref
from trioshed.api.openapi.usage import usage_paths
from trioshed.models.store import ModelStore

bp = Blueprint("openapi", __name__)

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


_STRINGS: Schema = {"type": "array", "items": _STR}
_PART = "[A-Za-z0-9][A-Za-z0-9._-]*"
# What the stores accept: model[:tag], letters, digits, '.', '_', '-'; with an Ollama store in
# TRIOSHED_MODELS also [host[:port]/][namespace/]model[:tag] (Ollama's "@sha256:..." suffix left out).
MODEL_NAME_PATTERN = rf"^\s*{_PART}(?::(?:{_PART})?)?\s*$"
OLLAMA_NAME_PATTERN = rf"^\s*(?:{_PART}(?::[0-9]+)?/)?(?:{_PART}/)?{_PART}(?::(?:{_PART})?)?\s*$"
_MODEL = _ref("ModelName")


def _model_name(ollama_names: bool) -> Schema:
    return {
        "type": "string",
        "pattern": OLLAMA_NAME_PATTERN if ollama_names else MODEL_NAME_PATTERN,
        "description": "a model name: `tiny`, `tiny:latest`"
        + (", `user/model:tag`, `registry.ollama.ai/library/llama3.2:1b`" if ollama_names else ""),
        "examples": ["gemma3-270m", "llama3.2:1b"],
    }

# Ollama's options: sampling (passed to llama-server) and runner options (choose the runner).
_OPTIONS_SAMPLING: Schema = {
    "num_predict": _INT, "temperature": _NUM, "top_k": _INT, "top_p": _NUM, "min_p": _NUM,
    "typical_p": _NUM, "seed": _INT, "stop": {"anyOf": [_STR, _STRINGS]}, "repeat_penalty": _NUM,
    "repeat_last_n": _INT, "presence_penalty": _NUM, "frequency_penalty": _NUM, "num_keep": _INT,
    "mirostat": _INT, "mirostat_tau": _NUM, "mirostat_eta": _NUM,
}  # fmt: skip
_OPTIONS_RUNNER: Schema = {
    "num_ctx": {"type": "integer", "minimum": 1}, "num_batch": {"type": "integer", "minimum": 1},
    "num_gpu": _INT, "main_gpu": {"type": "integer", "minimum": 0}, "use_mmap": _BOOL,
    "num_thread": {"type": "integer", "minimum": 0},
}  # fmt: skip

_ERROR_STATUSES = {
    "400": "Bad input: malformed JSON, a field of the wrong type, an unsafe model name.",
    "401": "TRIOSHED_API_KEY is set and the bearer token is missing or wrong.",
    "403": "The model is in a read-only Ollama store.",
    "404": "No such model in the store.",
    "409": "The change would break another models.toml entry, or models.toml cannot be edited safely.",
    "413": "The request body is larger than 64 MiB.",
    "500": "The model failed to load (llama-server's own message) or an internal error.",
    "502": "llama-server answered with an error.",
    "503": "Queue full, the model is in its load back-off, trioshed is shutting down, or (GET /api/events) too many pages follow the stream (Retry-After).",
    "501": "Something trioshed does not do: quantizing, or a file that is not GGUF.",
    "507": "The model cannot fit even with every other model unloaded, or only by evicting pinned models.",
}


_DIGEST: Schema = {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}


def _schemas(ollama_names: bool) -> Schema:
    message = _obj(
        {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": ["string", "null"]},
            "images": _STRINGS,
            "thinking": _STR,
            "tool_calls": {"type": "array", "items": {"type": "object"}},
            "tool_name": _STR,
        },
        ("role",),
    )
    common = {
        "model": _MODEL,
        "stream": {"type": "boolean", "default": True},
        "keep_alive": _ref("KeepAlive"),
        "options": _ref("Options"),
        "format": {"anyOf": [{"type": "string", "enum": ["json"]}, {"type": "object"}]},
        "think": {"anyOf": [_BOOL, {"type": "string", "enum": ["low", "medium", "high"]}]},
        "logprobs": _BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    }
    token = {"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}}  # Ollama's Logprob
    logprobs = {"type": "array", "items": _obj({**token, "top_logprobs": {"type": "array", "items": _obj(token)}}, ("token", "logprob"))}
    timings = {
        "total_duration": _INT, "load_duration": _INT, "prompt_eval_count": _INT,
        "prompt_eval_duration": _INT, "eval_count": _INT, "eval_duration": _INT,
    }  # fmt: skip
    details = _obj(
        {
            "parent_model": _STR, "format": _STR, "family": _STR,
            "families": {"type": ["array", "null"], "items": _STR}, "parameter_size": _STR,
            "quantization_level": _STR,
        }
    )  # fmt: skip
    openai_extras = {"model": _MODEL, "keep_alive": _ref("KeepAlive"), "options": _ref("Options"), "stream": _BOOL}
    return {
        "ModelName": _model_name(ollama_names),
        "Error": _obj({"error": _STR}, ("error",)),
        "OpenAIError": _obj(
            {"error": _obj({"message": _STR, "type": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}, ("message", "type"))},
            ("error",),
        ),
        "KeepAlive": {
            "description": "seconds, or a duration like `5m`, `1h`; negative: keep loaded forever; 0: unload when idle",
            "anyOf": [_NUM, {"type": "string", "minLength": 1}],
        },
        "Options": {
            "type": "object",
            "description": "Ollama's options: sampling, and runner options (a different value may reload the model). Unknown keys are ignored.",
            "properties": {**_OPTIONS_SAMPLING, **_OPTIONS_RUNNER},
        },
        "Message": message,
        "GenerateRequest": _obj(
            {
                **common, "prompt": _STR, "suffix": _STR, "system": _STR, "template": _STR, "raw": _BOOL,
                "images": _STRINGS, "context": {"type": "array", "items": _INT},
            },
            ("model",),
        ),
        "GenerateResponse": _obj(
            {"model": _STR, "created_at": _STR, "response": _STR, "thinking": _STR, "done": _BOOL, "done_reason": _STR, "context": {"type": "array", "items": _INT}, "logprobs": logprobs, **timings},
            ("model", "done"),
        ),
        "ChatRequest": _obj(
            {**common, "messages": {"type": "array", "items": _ref("Message")}, "tools": {"type": "array", "items": {"type": "object"}}},
            ("model",),
        ),
        "ChatResponse": _obj(
            {"model": _STR, "created_at": _STR, "message": _ref("Message"), "done": _BOOL, "done_reason": _STR, "logprobs": logprobs, **timings},
            ("model", "done"),
        ),
        "EmbedRequest": _obj(
            {
                "model": _MODEL, "input": {"anyOf": [_STR, _STRINGS]}, "truncate": _BOOL,
                "dimensions": {"type": "integer", "minimum": 1}, "keep_alive": _ref("KeepAlive"), "options": _ref("Options"),
            },
            ("model",),
        ),
        "EmbedResponse": _obj(
            {"model": _STR, "embeddings": {"type": "array", "items": {"type": "array", "items": _NUM}}, "total_duration": _INT, "load_duration": _INT, "prompt_eval_count": _INT},
            ("model", "embeddings"),
        ),
        "EmbeddingsRequest": _obj({"model": _MODEL, "prompt": _STR, "keep_alive": _ref("KeepAlive"), "options": _ref("Options")}, ("model",)),
        "EmbeddingsResponse": _obj({"embedding": {"type": "array", "items": _NUM}}, ("embedding",)),
        "ModelRequest": {
            **_obj({"model": _MODEL, "name": {**_MODEL, "description": "the same as model (older clients)"}}),
            "anyOf": [{"required": ["model"]}, {"required": ["name"]}],
        },
        "CopyRequest": _obj({"source": _MODEL, "destination": _MODEL}, ("source", "destination")),
        "CreateRequest": _obj({
            "model": {"type": "string", "pattern": OLLAMA_NAME_PATTERN}, "from": {"type": "string", "description": "a model to start from"},
            "files": {"type": "object", "additionalProperties": _DIGEST, "description": "file name -> digest of an uploaded blob (the GGUF model, a projector)"},
            "adapters": {"type": "object", "additionalProperties": _DIGEST, "description": "file name -> digest of an uploaded GGUF LoRA"},
            "template": _STR, "system": _STR, "license": {"anyOf": [_STR, {"type": "array", "items": _STR}]}, "stream": {"type": "boolean", "default": True},
            "parameters": {"type": "object"}, "messages": {"type": "array", "items": _obj({"role": {"type": "string", "enum": ["system", "user", "assistant"]}, "content": _STR})},
            "quantize": {"type": "string", "description": "not done: 400 for a quantized model, 501 for an F16/F32 one"},
            "modelfile": {"type": "string", "description": "the older request: a Modelfile's text (FROM a model or @sha256:<hex>)"},
        }, ("model",)),
        "PullRequest": _obj(
            {
                "model": {"type": "string", "pattern": OLLAMA_NAME_PATTERN, "examples": ["llama3.2:1b", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"],
                          "description": "Ollama's registry: `llama3.2:1b`, `user/model:tag`, `host[:port]/ns/model:tag`; Hugging Face: `hf.co/USER/REPO[:QUANT]`"},
                "name": {"type": "string", "description": "the older name of `model`"},
                "insecure": {"type": "boolean", "default": False, "description": "skip TLS checks; plain HTTP to the name's own registry host"},
                "stream": {"type": "boolean", "default": True},
            },
            ("model",),
        ),
        "PullProgress": _obj(
            {
                "status": {"type": "string", "examples": ["pulling manifest", "pulling 96c415656d37", "verifying sha256 digest", "writing manifest", "success"]},
                "digest": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
                "total": {"type": "integer", "minimum": 0},
                "completed": {"type": "integer", "minimum": 0},
            },
            ("status",),
        ),
        "Details": details,
        "ModelEntry": _obj(
            {"name": _STR, "model": _STR, "modified_at": _STR, "size": _INT, "digest": _STR, "details": details},
            ("name", "model", "size", "digest"),
        ),
        "TagsResponse": _obj({"models": {"type": "array", "items": _ref("ModelEntry")}}, ("models",)),
        "RunningModel": _obj(
            {
                "name": _STR, "model": _STR, "size": _INT, "size_vram": _INT, "digest": _STR, "details": {"type": "object"},
                "expires_at": _STR, "context_length": _INT,
            },
            ("name", "model", "size", "size_vram", "expires_at"),
        ),
        "PsResponse": _obj({"models": {"type": "array", "items": _ref("RunningModel")}}, ("models",)),
        "ShowResponse": _obj(
            {
                "modelfile": _STR, "parameters": _STR, "template": _STR, "details": details,
                "model_info": {"type": "object"}, "capabilities": _STRINGS, "modified_at": _STR,
                "projector_info": {"type": "object", "description": "the projector's GGUF header (a model that sees or hears)"},
            },
            ("details", "model_info", "capabilities"),
        ),
        "VersionResponse": _obj({"version": {**_STR, "description": "the Ollama API version trioshed serves"},
                                 "trioshed_version": {**_STR, "description": "trioshed's own version"}}, ("version", "trioshed_version")),
        "PinRequest": _obj({"model": _MODEL, "pinned": {"type": "boolean", "default": True}}, ("model",)),
        "PinResponse": _obj({"model": _STR, "pinned": _BOOL, "loaded": {"type": "boolean", "description": "whether a runner of it is loaded now"}}, ("model", "pinned", "loaded")),
        "OpenAIChatRequest": _obj(
            {
                **openai_extras,
                "messages": {"type": "array", "minItems": 1, "items": _obj({"role": _STR, "content": {}}, ("role",))},
                "max_tokens": {"type": ["integer", "null"]}, "max_completion_tokens": {"type": ["integer", "null"]},
                "temperature": {"type": ["number", "null"]}, "top_p": {"type": ["number", "null"]},
                "seed": {"type": ["integer", "null"]}, "stop": {"anyOf": [_STR, _STRINGS, {"type": "null"}]},
                "tools": {"type": "array", "items": {"type": "object"}}, "response_format": {"type": "object"},
                "stream_options": {"type": ["object", "null"]}, "logprobs": {"type": ["boolean", "null"]},
                "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
            },
            ("model", "messages"),
        ),
        "OpenAIResponsesRequest": _obj(
            {
                **openai_extras,
                "input": {"anyOf": [_STR, {"type": "array", "minItems": 1, "items": {"type": "object"}}],
                          "description": "text, or input items: message, function_call, function_call_output"},
                "instructions": {"type": ["string", "null"]}, "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
                "temperature": {"type": ["number", "null"]}, "top_p": {"type": ["number", "null"]},
                "tools": {"type": "array", "items": {"type": "object"}, "description": "function tools"},
                "text": {"type": "object", "description": "text.format: text, json_object or json_schema"},
                "stream": {"type": "boolean"},
                "previous_response_id": {"type": "null", "description": "responses are not stored: any value is a 400"},
            },
            ("model", "input"),
        ),
        "OpenAIResponseObject": _obj(
            {"id": _STR, "object": {"const": "response"}, "status": _STR, "model": _STR, "output": {"type": "array", "items": {"type": "object"}}},
            ("id", "object", "status", "model", "output"),
        ),
        "OpenAICompletionRequest": _obj(
            {
                **openai_extras, "prompt": {"anyOf": [_STR, _STRINGS]}, "max_tokens": {"type": ["integer", "null"]},
                "temperature": {"type": ["number", "null"]}, "top_p": {"type": ["number", "null"]},
                "seed": {"type": ["integer", "null"]}, "stop": {"anyOf": [_STR, _STRINGS, {"type": "null"}]},
                "suffix": {"type": ["string", "null"]}, "stream_options": {"type": ["object", "null"]},
                "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
            },
            ("model", "prompt"),
        ),
        "OpenAIEmbeddingRequest": _obj(
            {
                "model": _MODEL, "input": {"anyOf": [_STR, _STRINGS]}, "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                "dimensions": {"type": "integer", "minimum": 1}, "keep_alive": _ref("KeepAlive"), "options": _ref("Options"),
            },
            ("model", "input"),
        ),
        **_anthropic_schemas(),
        **llama.llama_schemas(), **rerank.rerank_schemas(),
        "OpenAIResponse": {"type": "object", "description": "OpenAI's answer as llama-server gives it, naming the model as the client did", "properties": {"object": _STR, "model": _STR}},
        "OpenAIModel": _obj({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "capabilities": _STRINGS}, ("id", "object")),
        "OpenAIModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("OpenAIModel")}}, ("object", "data")),
    }


def _anthropic_schemas() -> Schema:
    """Anthropic's Messages API: what ``/v1/messages`` and ``/v1/messages/count_tokens`` take and give."""
    block = {"type": "object", "properties": {"type": _STR}, "required": ["type"]}
    message = _obj({"role": {"type": "string", "enum": ["user", "assistant"]}, "content": {"anyOf": [_STR, {"type": "array", "items": block}]}},
                   ("role", "content"))  # fmt: skip
    conversation = {
        "model": _MODEL, "messages": {"type": "array", "minItems": 1, "items": message},
        "system": {"anyOf": [_STR, {"type": "array", "items": block}]},
        "tools": {"type": "array", "items": _obj({"name": _STR, "description": _STR, "input_schema": {"type": "object"}}, ("name", "input_schema"))},
        "tool_choice": _obj({"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": _STR, "disable_parallel_tool_use": _BOOL}, ("type",)),
        "thinking": _obj({"type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": _INT}, ("type",)),
        "keep_alive": _ref("KeepAlive"), "options": _ref("Options"),
    }  # fmt: skip
    usage = _obj({"input_tokens": _INT, "output_tokens": _INT, "cache_creation_input_tokens": _INT, "cache_read_input_tokens": _INT},
                 ("input_tokens", "output_tokens"))  # fmt: skip
    return {
        "AnthropicMessagesRequest": _obj(
            {
                **conversation, "max_tokens": {"type": "integer", "minimum": 1}, "stream": _BOOL,
                "stop_sequences": _STRINGS, "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "metadata": {"type": "object"},
            },
            ("model", "max_tokens", "messages"),
        ),
        "AnthropicCountTokensRequest": _obj(conversation, ("model", "messages")),
        "AnthropicMessage": _obj(
            {
                "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
                "content": {"type": "array", "items": block},
                "stop_reason": {"type": ["string", "null"], "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
                "stop_sequence": {"type": ["string", "null"]}, "usage": usage,
            },
            ("id", "type", "role", "model", "content", "stop_reason", "usage"),
        ),
        "AnthropicTokenCount": _obj({"input_tokens": _INT}, ("input_tokens",)),
        "AnthropicError": _obj({"type": {"const": "error"}, "error": _obj({"type": _STR, "message": _STR}, ("type", "message"))}, ("type", "error")),
    }


def _errors(*statuses: str, openai: bool = False, anthropic: bool = False) -> Schema:
    schema = _ref("AnthropicError") if anthropic else _ref("OpenAIError") if openai else _ref("Error")
    return {s: {"description": _ERROR_STATUSES[s], "content": {"application/json": {"schema": schema}}} for s in statuses}


_MODEL_ERRORS = ("400", "401", "404", "413", "500", "502", "503", "507")


#: One server-sent event as OpenAPI 3.2 (and schemathesis) read a text/event-stream: ``data`` is a
#: JSON chunk, an error object, or "[DONE]"; a plain string schema failed every event (fuzzing).
_SSE_EVENT: Schema = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
}


def _json_op(summary: str, request: str, response: Schema, *, stream: str | None = None, errors: tuple[str, ...] = _MODEL_ERRORS,
             openai: bool = False, anthropic: bool = False) -> Schema:
    content: Schema = {"application/json": {"schema": response}}
    if stream is not None:
        content[stream] = {"schema": response if stream == NDJSON else _SSE_EVENT}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the answer" + (" (streamed unless `stream` is false)" if stream == NDJSON else ""), "content": content},
                      **_errors(*errors, openai=openai, anthropic=anthropic)},
    }


def _get_op(summary: str, content_type: str, schema: Schema, *, auth: bool = True) -> Schema:
    op: Schema = {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {"schema": schema}}}}}
    if auth:
        op["responses"].update(_errors("401"))
    else:
        op["security"] = []
    return op


_NO_ROOM: Schema = {"507": {"description": "Not enough disk space.", "content": {"application/json": {"schema": _ref("Error")}}}}


def _progress_op(summary: str, request: str, lines: str, errors: tuple[str, ...]) -> Schema:
    """A route that streams Ollama's progress lines (push, create)."""
    progress = _ref("PullProgress")
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": f"progress lines ({lines}); with `stream` false, the last line",
                                  "content": {"application/json": {"schema": progress}, NDJSON: {"schema": {"anyOf": [progress, _ref("Error")]}}}},
                          **_errors(*errors), **_NO_ROOM}}  # fmt: skip


def _paths() -> Schema:
    ollama = ("400", "401", "404", "413", "500", "502", "503", "507")
    digest = {"name": "digest", "in": "path", "required": True, "schema": _DIGEST}
    return {
        "/": {
            "get": {
                **_get_op("Liveness: `Ollama is running` (a browser asking for HTML gets it with links to /ui)", "text/plain", _STR, auth=False),
                "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": _STR}, "text/html": {"schema": _STR}}}},
            },
            "head": {"summary": "Liveness", "security": [], "responses": {"200": {"description": "OK"}}},
        },
        "/api/version": {"get": _get_op("The Ollama API version served, and trioshed's own", "application/json", _ref("VersionResponse"))},
        "/api/generate": {"post": _json_op("Generate a completion (Ollama); no prompt: load, or unload with keep_alive 0", "GenerateRequest", _ref("GenerateResponse"), stream=NDJSON, errors=ollama)},
        "/api/chat": {"post": _json_op("Chat (Ollama); no messages: load, or unload with keep_alive 0", "ChatRequest", _ref("ChatResponse"), stream=NDJSON, errors=ollama)},
        "/api/embed": {"post": _json_op("Embeddings for one input or several (Ollama)", "EmbedRequest", _ref("EmbedResponse"))},
        "/api/embeddings": {"post": _json_op("One embedding (Ollama's older route)", "EmbeddingsRequest", _ref("EmbeddingsResponse"))},
        "/api/tags": {"get": _get_op("Models in the store", "application/json", _ref("TagsResponse"))},
        "/api/ps": {"get": _get_op("Loaded models", "application/json", _ref("PsResponse"))},
        "/api/fleet/state": {"get": {**_get_op("This node's state, for the other nodes of its fleet (the fleet secret, not an API key)", "application/json", {"type": "object"}), "security": [], "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}, **_errors("401", "403")}}},
        "/api/show": {"post": _json_op("A model's details, GGUF metadata and memory estimate", "ModelRequest", _ref("ShowResponse"), errors=("400", "401", "404", "413", "500"))},
        "/api/delete": {
            "delete": {
                "summary": "Delete a model from trioshed's own store (unloaded first); an Ollama store is read-only (403)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ModelRequest")}}},
                "responses": {"200": {"description": "deleted"}, **_errors("400", "401", "403", "404", "409", "413", "500")},
            }
        },
        "/api/copy": {
            "post": {
                "summary": "Add an alias for a model (in models.toml)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("CopyRequest")}}},
                "responses": {"200": {"description": "copied"}, **_errors("400", "401", "404", "409", "413", "500")},
            }
        },
        "/api/pull": {
            "post": {
                "summary": "Download a model from Ollama's registry or a Hugging Face GGUF repository into trioshed's store (its pulled/ folder)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("PullRequest")}}},
                "responses": {
                    "200": {
                        "description": "progress lines as Ollama streams them (a failure after the start is a last `{\"error\": ...}` line); with `stream` false, the last line",
                        "content": {"application/json": {"schema": _ref("PullProgress")},
                                    NDJSON: {"schema": {"anyOf": [_ref("PullProgress"), _ref("Error")]}}},
                    },
                    **_errors("400", "401", "413", "500"),
                    "403": {"description": "Every folder of TRIOSHED_MODELS is a read-only Ollama store: nowhere to pull to.", "content": {"application/json": {"schema": _ref("Error")}}},
                    "404": {"description": "The registry (or Hugging Face) has no such model, or no GGUF file for the quant.", "content": {"application/json": {"schema": _ref("Error")}}},
                    "501": {"description": "The model cannot be served by llama-server (no GGUF layer), or is a split GGUF.", "content": {"application/json": {"schema": _ref("Error")}}},
                    "502": {"description": "The registry could not be reached, refused access, or sent something invalid (a wrong digest, more bytes than its manifest says); nothing was kept.", "content": {"application/json": {"schema": _ref("Error")}}},
                    "507": {"description": "Not enough disk space for the download.", "content": {"application/json": {"schema": _ref("Error")}}},
                },
            }
        },
        "/api/push": {"post": _progress_op("Send a pulled or created model to an Ollama-protocol registry (its name says where)", "PullRequest",
                                           "`retrieving manifest`, `pushing <12 hex>`, `pushing manifest`, `success`", ("400", "401", "404", "413", "500", "502"))},
        "/api/create": {"post": _progress_op("Create a model from uploaded files, another model or a Modelfile's text, in trioshed's store (its pulled/ folder)",
                                             "CreateRequest", "`using existing layer …`, `creating new layer …`, `writing manifest`, `success`",
                                             ("400", "401", "403", "404", "409", "413", "500", "501"))},
        "/api/blobs/{digest}": {"parameters": [digest], "head": {"summary": "Whether a blob is in trioshed's store", "responses": {"200": {"description": "present"}, "404": {"description": "absent"}, **_errors("400", "401")}},
                                "post": {"summary": "Upload a blob (streamed, its sha256 checked before it is kept)", "requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                                         "responses": {"201": {"description": "stored"}, "200": {"description": "already present"}, **_errors("400", "401", "403", "413", "500"), **_NO_ROOM}}},
        "/v1/chat/completions": {"post": _json_op("Chat completions (OpenAI)", "OpenAIChatRequest", _ref("OpenAIResponse"), stream=SSE, openai=True)},
        "/v1/responses": {"post": _json_op("Responses (OpenAI; stateless: nothing is stored)", "OpenAIResponsesRequest", _ref("OpenAIResponseObject"), stream=SSE, openai=True)},
        "/v1/completions": {"post": _json_op("Completions (OpenAI)", "OpenAICompletionRequest", _ref("OpenAIResponse"), stream=SSE, openai=True)},
        "/v1/messages": {"post": _json_op("Messages (Anthropic): Claude Code and the anthropic SDK; streamed as Anthropic's events when `stream` is true",
                                          "AnthropicMessagesRequest", _ref("AnthropicMessage"), stream=SSE, anthropic=True)},
        "/v1/messages/count_tokens": {"post": _json_op("Count a conversation's input tokens with the model's template and tokenizer (Anthropic)",
                                                       "AnthropicCountTokensRequest", _ref("AnthropicTokenCount"), anthropic=True)},
        "/v1/embeddings": {"post": _json_op("Embeddings (OpenAI)", "OpenAIEmbeddingRequest", _ref("OpenAIResponse"), openai=True)},
        "/v1/models": {"get": _get_op("Models in the store (OpenAI)", "application/json", _ref("OpenAIModelList"))},
        "/v1/models/{model}": {
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": _MODEL}],
            "get": {
                "summary": "One model (OpenAI)",
                "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": _ref("OpenAIModel")}}}, **_errors("400", "401", "404", openai=True)},
            },
        },
        "/api/pin": {"post": _json_op("Pin or unpin a model until trioshed restarts (as models.toml's pinned; the file is not changed)", "PinRequest", _ref("PinResponse"), errors=("400", "401", "404", "413"))},
        "/api/events": {
            "get": {
                "summary": "The status page's live stream: server-sent events `hello`, `state`, `events`, `log` (see docs/status-page.md)",
                "responses": {
                    "200": {"description": "an endless stream; a keep-alive comment at least every 5 s", "content": {SSE: {"schema": _SSE_EVENT}}},
                    **_errors("401", "503"),
                },
            }
        },
        "/ui": {"get": _get_op("The status page (HTML; served without the API key, which the page asks for)", "text/html", _STR, auth=False)},
        "/ui/ui.js": {"get": _get_op("The status page's script", "text/javascript", _STR, auth=False)},
        "/ui/ui.css": {"get": _get_op("The status page's style sheet", "text/css", _STR, auth=False)},
        "/metrics": {"get": _get_op("Prometheus metrics (text exposition format 0.0.4)", "text/plain", _STR)},
        "/openapi.json": {"get": _get_op("This document", "application/json", {"type": "object"})},
        **llama.llama_paths(), **usage_paths(), **keys_paths(), **rerank.rerank_paths(), **audio.audio_paths(),
    }


@functools.cache
def document(ollama_names: bool = False) -> Schema:
    """The document; ``ollama_names``: an Ollama store is among TRIOSHED_MODELS (names with '/')."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "trioshed",
            "version": __version__,
            "description": "Ollama's API (/api/*), OpenAI's (/v1/*) and Anthropic's Messages (/v1/messages) over llama.cpp runners that trioshed schedules.",
            "license": {"name": "MIT", "identifier": "MIT"},
        },
        "servers": [{"url": "http://127.0.0.1:11434"}],
        "security": [{}, {"bearer": []}],
        "paths": _paths(),
        "components": {
            "schemas": _schemas(ollama_names),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "required when TRIOSHED_API_KEY is set"}},
        },
    }


@bp.get("/openapi.json")
async def openapi() -> Schema:
    store = current_app.config["TRIOSHED"].store
    return document(any(not isinstance(b, ModelStore) for b in store.backends()))
