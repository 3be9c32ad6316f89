"""The OpenAPI description of llama-server's own routes (:mod:`trioshed.api.routes.llama`): ``/infill``,
``/tokenize``, ``/detokenize``, ``/apply-template`` and ``/upstream/<model>/<path>``, merged into
``/openapi.json`` by :mod:`trioshed.api.openapi.document`. Their fields as llama-server reads them (other
fields pass through), their errors in llama.cpp's shape."""

from __future__ import annotations

from trioshed.api.openapi.parts import BOOL as _BOOL
from trioshed.api.openapi.parts import INT as _INT
from trioshed.api.openapi.parts import NUM as _NUM
from trioshed.api.openapi.parts import STR as _STR
from trioshed.api.openapi.parts import Schema
from trioshed.api.openapi.parts import obj as _obj
from trioshed.api.openapi.parts import ref as _ref

SSE = "text/event-stream"


#: One server-sent event (as :mod:`trioshed.api.openapi.document` describes them).
_SSE_EVENT: Schema = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
}

_STATUSES = {
    "400": "Bad input: malformed JSON, a field of the wrong type, no model, a model without FIM tokens asked to infill, token ids outside the vocabulary, a path with '..' or encoded slashes.",
    "401": "TRIOSHED_API_KEY is set and the bearer token is missing or wrong.",
    "403": "An Origin or Host that is not allowed; a llama-server route that is not forwarded (`/slots`, `POST /props`, anything not listed in docs/api.md).",
    "404": "No such model in the store.",
    "413": "The request body is larger than TRIOSHED_MAX_BODY.",
    "500": "The model failed to load, or an internal error.",
    "502": "llama-server answered with an error.",
    "503": "Queue full, the model is in its load back-off, or trioshed is shutting down (Retry-After).",
    "507": "The model cannot fit even with every other model unloaded.",
}
_MODEL_ERRORS = ("400", "401", "403", "404", "413", "500", "502", "503", "507")


def _errors(*statuses: str) -> Schema:
    return {s: {"description": _STATUSES[s], "content": {"application/json": {"schema": _ref("LlamaError")}}} for s in statuses}


def llama_schemas() -> Schema:
    """The components: each route's request and answer, and llama.cpp's error."""
    extras = {"model": _ref("ModelName"), "keep_alive": _ref("KeepAlive"), "options": _ref("Options")}
    piece = _obj({"id": _INT, "piece": {"anyOf": [_STR, {"type": "array", "items": _INT}]}}, ("id", "piece"))
    return {
        "LlamaInfillRequest": _obj(
            {**extras, "input_prefix": _STR, "input_suffix": _STR, "input_extra": {"type": "array", "items": _obj({"filename": _STR, "text": _STR})},
             "prompt": _STR, "stream": {"type": "boolean", "default": False}, "n_predict": _INT, "n_probs": _INT,
             "post_sampling_probs": _BOOL, "temperature": _NUM, "top_k": _INT, "top_p": _NUM, "seed": _INT,
             "stop": {"type": "array", "items": _STR}, "cache_prompt": _BOOL},
            ("model",),
        ),
        "LlamaCompletion": _obj({"content": _STR, "stop": _BOOL, "model": _STR, "tokens_predicted": _INT, "tokens_evaluated": _INT}),
        "LlamaTokenizeRequest": _obj({**extras, "content": _STR, "add_special": _BOOL, "parse_special": _BOOL, "with_pieces": _BOOL}, ("model",)),
        "LlamaTokens": _obj({"tokens": {"type": "array", "items": {"anyOf": [_INT, piece]}}}, ("tokens",)),
        "LlamaDetokenizeRequest": _obj({**extras, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}, ("model",)),
        "LlamaContent": _obj({"content": _STR}, ("content",)),
        "LlamaApplyTemplateRequest": _obj(
            {**extras, "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}}, "tools": {"type": "array"}}, ("model", "messages")
        ),
        "LlamaPrompt": _obj({"prompt": _STR}, ("prompt",)),
        "LlamaError": _obj({"error": _obj({"code": _INT, "message": _STR, "type": _STR}, ("code", "message", "type"))}, ("error",)),
    }


def _post(summary: str, request: str, response: str, *, stream: bool = False) -> Schema:
    content: Schema = {"application/json": {"schema": _ref(response)}}
    if stream:
        content[SSE] = {"schema": _SSE_EVENT}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": "llama-server's answer" + (" (streamed with `stream` true)" if stream else ""), "content": content},
                          **_errors(*_MODEL_ERRORS)},
        }
    }  # fmt: skip


def llama_paths() -> Schema:
    """The routes."""
    rest = {"name": "rest", "in": "path", "required": True,
            "schema": {"type": "string", "description": "`<model>/<llama-server path>`, e.g. `tiny/props`, `tiny/v1/chat/completions`"}}  # fmt: skip
    answer = {"200": {"description": "llama-server's answer, as it gives it",
                      "content": {"application/json": {"schema": {"type": "object"}}, SSE: {"schema": _SSE_EVENT}}}}  # fmt: skip
    return {
        "/infill": _post("Fill in the middle (llama.cpp's /infill, what llama.vscode and llama.vim call); 400 for a model without FIM tokens",
                         "LlamaInfillRequest", "LlamaCompletion", stream=True),
        "/tokenize": _post("Tokenize with the model's tokenizer (llama.cpp)", "LlamaTokenizeRequest", "LlamaTokens"),
        "/detokenize": _post("Token ids back to text (llama.cpp)", "LlamaDetokenizeRequest", "LlamaContent"),
        "/apply-template": _post("Render messages with the model's chat template (llama.cpp)", "LlamaApplyTemplateRequest", "LlamaPrompt"),
        "/upstream/{rest}": {
            "parameters": [rest],
            "get": {"summary": "A llama-server read route of the model's runner (loaded if needed): /health, /v1/health, /props (without the file path), /models, /v1/models",
                    "responses": {**answer, **_errors("400", "401", "403", "404", "500", "502", "503", "507")}},
            "post": {"summary": "A llama-server generating or tokenizing route of the model's runner (loaded if needed), forwarded as sent",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
                     "responses": {**answer, **_errors(*_MODEL_ERRORS)}},
        },
    }  # fmt: skip
