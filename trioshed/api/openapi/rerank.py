"""The OpenAPI description of the rerank routes (:mod:`trioshed.api.routes.rerank`): ``/v1/rerank``,
llama.cpp's aliases ``/rerank`` and ``/v1/reranking``, and Cohere v2's ``/v2/rerank``, merged into
``/openapi.json`` by :mod:`trioshed.api.openapi.document`. Errors in the rerank shape: OpenAI's body plus
Cohere's top-level ``message``."""

from __future__ import annotations

from trioshed.api.openapi.parts import BOOL as _BOOL
from trioshed.api.openapi.parts import INT as _INT
from trioshed.api.openapi.parts import NUM as _NUM
from trioshed.api.openapi.parts import STR as _STR
from trioshed.api.openapi.parts import Schema
from trioshed.api.openapi.parts import obj as _obj
from trioshed.api.openapi.parts import ref as _ref

_STATUSES = {
    "400": "Bad input: malformed JSON, a field of the wrong type, empty documents, top_n outside 1..the number of documents, "
    "a model that is no reranker, a query-document pair longer than the context.",
    "401": "TRIOSHED_API_KEY is set and the bearer token is missing or wrong.",
    "404": "No such model in the store.",
    "413": "The request body is larger than TRIOSHED_MAX_BODY.",
    "500": "The model failed to load, or an internal error.",
    "502": "llama-server answered with an error.",
    "503": "Queue full, the model is in its load back-off, or trioshed is shutting down (Retry-After).",
    "507": "The model cannot fit even with every other model unloaded.",
}

ROUTES = (
    ("/v1/rerank", "llama.cpp, Jina, Cohere v1"),
    ("/rerank", "llama.cpp's alias"),
    ("/v1/reranking", "llama.cpp's alias"),
    ("/v2/rerank", "Cohere v2"),
)


def rerank_schemas() -> dict[str, Schema]:
    """The request, answer and error bodies (``components.schemas``)."""
    text = _obj({"text": _STR}, ("text",))
    return {
        "RerankRequest": _obj(
            {
                "model": _ref("ModelName"), "query": {"type": "string", "minLength": 1},
                "documents": {"type": "array", "minItems": 1, "items": {"anyOf": [_STR, text]}},
                "top_n": {"type": "integer", "minimum": 1}, "return_documents": _BOOL,
                "rank_fields": {"type": "array", "items": _STR}, "keep_alive": _ref("KeepAlive"), "options": _ref("Options"),
            },
            ("model", "query", "documents"),
        ),
        "RerankResponse": _obj(
            {
                "id": _STR, "model": _STR, "object": {"const": "list"},
                "results": {"type": "array", "items": _obj({"index": _INT, "relevance_score": _NUM, "document": text}, ("index", "relevance_score"))},
                "usage": _obj({"prompt_tokens": _INT, "total_tokens": _INT}),
                "meta": {"type": "object"},
            },
            ("results",),
        ),
        "RerankError": _obj(
            {
                "error": _obj({"message": _STR, "type": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]},
                               "code": {"type": ["string", "integer", "null"]}}, ("message", "type")),
                "message": _STR,
            },
            ("error", "message"),
        ),
    }


def rerank_paths() -> dict[str, Schema]:
    """The four routes (``paths``)."""
    errors = {s: {"description": d, "content": {"application/json": {"schema": _ref("RerankError")}}} for s, d in _STATUSES.items()}
    return {
        path: {
            "post": {
                "summary": f"Rerank documents against a query with a reranker ({who})",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("RerankRequest")}}},
                "responses": {"200": {"description": "the documents by relevance", "content": {"application/json": {"schema": _ref("RerankResponse")}}}, **errors},
            }
        }
        for path, who in ROUTES
    }
