"""Rerank: the bodies llama.cpp's ``/v1/rerank``, Jina's and Cohere's (v1 and v2) clients send,
as one llama-server request, and its answer in a shape each of them parses. Pure (no I/O).

Request: ``query`` (a string), ``documents`` (strings, or objects with ``text``; with Cohere v1's
``rank_fields`` the named fields joined as ``field: value`` lines), ``top_n`` (1 to the number of
documents; absent: all), ``return_documents`` (default false: Cohere's default; each result then
carries ``document: {"text": ...}``). ``model`` names a reranker (a GGUF with rank pooling or a
classifier head). Other fields of those clients (``max_chunks_per_doc``, ``max_tokens_per_doc``,
``priority``) are accepted and have no effect.

Answer: ``results`` sorted by ``relevance_score`` (highest first, ties by ``index``), each with
the document's ``index`` in the request; ``usage`` (llama.cpp's and Jina's ``prompt_tokens`` /
``total_tokens``) and ``meta`` (Cohere's, with the tokens billed as ``input_tokens``). The scores
are llama-server's, to the float.

A query-document pair longer than the runner's context: llama-server refuses it (it does not cut
rerank documents); trioshed answers a 400 naming the pair's tokens and the context
(:func:`too_long_message`), never llama-server's own 500.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trioshed.api.pipeline.limits import json_type
from trioshed.core.context import tokens_upper_bound
from trioshed.errors import BadRequest, UpstreamError

#: The most documents one request may rank (Cohere's own bound is 1,000 per request).
MAX_DOCUMENTS = 10_000

#: llama-server's refusals of an input for its length: over the micro-batch, or over the context.
_TOO_LARGE = re.compile(rb"input \((\d+) tokens\) is (?:too large|larger than the max context)")


@dataclass(frozen=True)
class RerankRequest:
    query: str
    documents: tuple[str, ...]
    top_n: int | None
    return_documents: bool


def _document_text(doc: object, index: int, rank_fields: list[str] | None) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, Mapping):
        if rank_fields:
            missing = [f for f in rank_fields if not isinstance(doc.get(f), str)]
            if missing:
                raise BadRequest(f'"documents"[{index}] has no string field {missing[0]!r} named in "rank_fields"')
            return "\n".join(f"{f}: {doc[f]}" for f in rank_fields)
        if isinstance(doc.get("text"), str):
            return str(doc["text"])
    raise BadRequest(f'"documents"[{index}] must be a string or an object with a string "text", got {json_type(doc)}')


def parse(body: Mapping[str, Any]) -> RerankRequest:
    """The request's fields checked, else BadRequest (before any runner is leased)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise BadRequest(f'"query" must be a string, got {json_type(query)}')
    if not query.strip():
        raise BadRequest('"query" must not be empty')
    documents = body.get("documents")
    if not isinstance(documents, list):
        raise BadRequest(f'"documents" must be a list of strings or of objects with "text", got {json_type(documents)}')
    if not documents:
        raise BadRequest('"documents" must not be empty')
    if len(documents) > MAX_DOCUMENTS:
        raise BadRequest(f'"documents" has {len(documents)} items: at most {MAX_DOCUMENTS} in one request')
    rank_fields = body.get("rank_fields")
    if rank_fields is not None and not (isinstance(rank_fields, list) and all(isinstance(f, str) for f in rank_fields)):
        raise BadRequest('"rank_fields" must be a list of strings')
    texts = tuple(_document_text(d, i, rank_fields) for i, d in enumerate(documents))
    top_n = body.get("top_n")
    if top_n is not None:
        if not isinstance(top_n, int) or isinstance(top_n, bool):
            raise BadRequest(f'"top_n" must be an integer, got {json_type(top_n)}')
        if not 1 <= top_n <= len(texts):
            raise BadRequest(f'"top_n" must be from 1 to the number of documents ({len(texts)}), got {top_n}')
    return_documents = body.get("return_documents", False)
    if return_documents is None:
        return_documents = False
    if not isinstance(return_documents, bool):
        raise BadRequest(f'"return_documents" must be true or false, got {json_type(return_documents)}')
    return RerankRequest(query, texts, top_n, return_documents)


def need(req: RerankRequest) -> int:
    """At most how many tokens the longest query-document pair takes (each pair has a slot's
    context to itself): sizes the automatic context."""
    pair = len(req.query.encode()) + max(len(d.encode()) for d in req.documents)
    return tokens_upper_bound(pair, 2)


def upstream_body(req: RerankRequest) -> dict[str, Any]:
    """llama-server's ``/v1/rerank`` body: every document (trioshed sorts and cuts itself)."""
    return {"query": req.query, "documents": list(req.documents)}


def too_long(status: int, raw: bytes) -> int | None:
    """The tokens of the pair llama-server refused as too long (None: not that refusal)."""
    if status not in (400, 500):
        return None
    m = _TOO_LARGE.search(raw)
    return int(m[1]) if m else None


def too_long_message(tokens: int, context: int) -> str:
    return (
        f"a query-document pair has {tokens} tokens, more than the context length of {context}: "
        "shorten the query or the documents (documents are not cut), or raise num_ctx"
    )


def response(answer: Mapping[str, Any], req: RerankRequest, model: str, request_id: str) -> dict[str, Any]:
    """The answer for the client: sorted, cut to ``top_n``, with documents when asked."""
    results = answer.get("results")
    n = len(req.documents)
    if not isinstance(results, list) or not all(
        isinstance(r, Mapping)
        and isinstance(r.get("index"), int)
        and 0 <= r["index"] < n
        and isinstance(r.get("relevance_score"), int | float)
        for r in results
    ):
        raise UpstreamError(f"llama-server sent an unexpected rerank answer: {str(answer)[:200]}")
    ranked = sorted(results, key=lambda r: (-float(r["relevance_score"]), r["index"]))
    if req.top_n is not None:
        ranked = ranked[: req.top_n]
    out = []
    for r in ranked:
        item: dict[str, Any] = {"index": r["index"], "relevance_score": r["relevance_score"]}
        if req.return_documents:
            item["document"] = {"text": req.documents[r["index"]]}
        out.append(item)
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens", 0) if isinstance(usage, Mapping) else 0
    return {
        "id": request_id,
        "model": model,
        "object": "list",
        "results": out,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
    }
