"""Rerank through trioshed against the same llama-server run alone (real binary, a tiny
rank-pooled GGUF), through the ``cohere`` SDK (v1 and v2) and raw llama.cpp/Jina bodies, and bad
input refused in the route's shape with nothing loaded."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import cohere
import httpx
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.api.protocols import rerank as protocol
from trioshed.errors import BadRequest
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server

QUERY = "where do zebras graze"
DOCS = ["zebras graze on the savanna", "a lazy dog sleeps", "quick brown fox", "seven zebras quietly graze", "hello world"]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture
def ranker_store(model_store: Path) -> Path:
    add_tiny(model_store, "ranker", pooling_type=4, context_length=512)
    return model_store


def _direct(model: Path) -> dict[str, Any]:
    args = ["--rerank", "-c", "512", "-b", "512", "-ub", "512", "--device", "none", "-t", "1", "-np", "1"]
    with running_llama_server(model, args, timeout=60) as server:
        return _post(f"{server.url}/v1/rerank", {"query": QUERY, "documents": DOCS})


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def test_rerank_equals_llama_server_alone_through_every_client(ranker_store: Path) -> None:
    direct = await trio.to_thread.run_sync(_direct, ranker_store / "ranker.gguf")
    expected = sorted(direct["results"], key=lambda r: (-r["relevance_score"], r["index"]))
    with trio.fail_after(120):
        async with open_test_server(ranker_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/v2/rerank"):
                r = await http.post(path, json={"model": "ranker", "query": QUERY, "documents": DOCS})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["results"] == expected  # llama-server's scores, to the float, sorted
                assert body["usage"] == {"prompt_tokens": direct["usage"]["prompt_tokens"], "total_tokens": direct["usage"]["prompt_tokens"]}
                assert body["model"] == "ranker"
            # Jina's body: documents as objects, top_n, return_documents
            r = await http.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": True})
            assert r.json()["results"] == [{**e, "document": {"text": DOCS[e["index"]]}} for e in expected[:2]]
            v1 = cohere.Client(base_url=server.base_url, api_key="unused")
            got = await in_thread(v1.rerank, model="ranker", query=QUERY, documents=DOCS, top_n=3, return_documents=True)
            assert [(x.index, x.relevance_score, x.document.text) for x in got.results] == [
                (e["index"], e["relevance_score"], DOCS[e["index"]]) for e in expected[:3]
            ]
            v2 = cohere.ClientV2(base_url=server.base_url, api_key="unused")
            got = await in_thread(v2.rerank, model="ranker", query=QUERY, documents=DOCS)
            assert [(x.index, x.relevance_score) for x in got.results] == [(e["index"], e["relevance_score"]) for e in expected]
            # the capability, in /api/show and /v1/models
            show = (await http.post("/api/show", json={"model": "ranker"})).json()
            assert show["capabilities"] == ["rerank"]
            listed = {m["id"]: m["capabilities"] for m in (await http.get("/v1/models")).json()["data"]}
            assert listed == {"ranker": ["rerank"], "tiny": ["completion"]}
            # a pair over the context: a 400 in the route's words, not llama-server's 500
            r = await http.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": ["ok", "word " * 200]})
            assert r.status_code == 400, r.text
            assert r.json()["message"].startswith("a query-document pair has ") and "context length of 512" in r.json()["message"]
            assert "physical batch" not in r.text
            assert server.scheduler.statistics().loads == 1
            ps = (await http.get("/api/ps")).json()["models"]
            assert [m["name"] for m in ps] == ["ranker:latest"] and ps[0]["size"] > 0


BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"model": "ranker", "query": "q", "documents": []}, 400, '"documents" must not be empty'),
    ({"model": "ranker", "query": "q", "documents": ["a"], "top_n": 0}, 400, '"top_n" must be from 1 to the number of documents (1), got 0'),
    ({"model": "ranker", "query": "q", "documents": ["a", "b"], "top_n": 3}, 400, '"top_n" must be from 1 to the number of documents (2), got 3'),
    ({"model": "ranker", "query": "q", "documents": ["a"], "top_n": "1"}, 400, '"top_n" must be an integer, got string'),
    ({"model": "ranker", "query": 5, "documents": ["a"]}, 400, '"query" must be a string, got number'),
    ({"model": "ranker", "query": " ", "documents": ["a"]}, 400, '"query" must not be empty'),
    ({"model": "ranker", "query": "q", "documents": "a"}, 400, '"documents" must be a list of strings or of objects with "text", got string'),
    ({"model": "ranker", "query": "q", "documents": [{"title": "a"}]}, 400, '"documents"[0] must be a string or an object with a string "text", got object'),
    ({"model": "ranker", "query": "q", "documents": ["a"], "return_documents": "yes"}, 400, '"return_documents" must be true or false, got string'),
    ({"query": "q", "documents": ["a"]}, 400, '"model" is required: the name of a reranker'),
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, ""),
    ({"model": "tiny", "query": "q", "documents": ["a"]}, 400, '"tiny" does not support rerank'),
]


async def test_bad_input_is_refused_in_the_routes_shape_before_any_load(ranker_store: Path) -> None:
    USER = [{"role": "user", "content": "hi"}]
    with trio.fail_after(60):
        async with open_test_server(ranker_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
                for body, status, message in BAD:
                    r = await http.post(path, json=body)
                    assert r.status_code == status, (path, body, r.text)
                    error = r.json()
                    assert error["error"]["message"] == error["message"]
                    assert error["error"]["type"] in ("invalid_request_error", "not_found_error")
                    if message:
                        assert error["message"] == message, (path, body)
            r = await http.post("/v1/chat/completions", json={"model": "ranker", "messages": USER})
            assert (r.status_code, r.json()["error"]["message"]) == (400, '"ranker" does not support chat')
            r = await http.post("/api/chat", json={"model": "ranker", "messages": USER})
            assert (r.status_code, r.json()) == (400, {"error": '"ranker" does not support chat'})
            assert server.scheduler.statistics().runners == ()


def test_results_are_sorted_cut_and_checked() -> None:
    req = protocol.parse({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2, "return_documents": True})
    answer = {"results": [{"index": 0, "relevance_score": 0.1}, {"index": 1, "relevance_score": 0.9}, {"index": 2, "relevance_score": 0.9}], "usage": {"prompt_tokens": 7}}
    out = protocol.response(answer, req, "m", "id")
    assert out["results"] == [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}, {"index": 2, "relevance_score": 0.9, "document": {"text": "c"}}]
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    fields = protocol.parse({"query": "q", "documents": [{"title": "T", "body": "B"}], "rank_fields": ["title", "body"]})
    assert fields.documents == ("title: T\nbody: B",)
    with pytest.raises(BadRequest, match="rank_fields"):
        protocol.parse({"query": "q", "documents": [{"title": "T"}], "rank_fields": ["body"]})
    assert protocol.too_long(500, b'{"error":{"message":"input (1214 tokens) is too large to process. increase the physical batch size"}}') == 1214
    assert protocol.too_long(400, b"input (1024 tokens) is larger than the max context size (512 tokens). skipping") == 1024
    assert protocol.too_long(500, b"other") is None


def test_every_rerank_route_is_a_user_route() -> None:
    from trioshed import access
    from trioshed.api.openapi.rerank import ROUTES

    assert [access.route_role("POST", path) for path, _ in ROUTES] == ["user"] * 4
