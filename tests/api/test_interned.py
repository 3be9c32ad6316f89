"""Serving interns no string per request: CPython's interned-string table keeps its size under load.

A string interned and freed again leaves a dummy entry in the table (``tests.api.interned``); one per
request doubled the table after ~6,000 requests of a soak (0.94 MB more, for good). ``pathlib``
interns every part of a path it parses, so a request that builds a ``Path`` from a model's file
name did it: the model store's lookups, listing and hashing now work on strings.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.api.interned import InternedTable
from trioshed.models.stores import Stores
from trioshed.testing.ollama_store import add_ollama_model
from trioshed.testing.server import open_test_server

N = 200


@pytest.fixture(scope="module")
def table() -> Iterator[InternedTable]:
    found = InternedTable()  # raises where the layout is not CPython 3.11's: no silent skip
    yield found
    found.close()


def entries_per_call(table: InternedTable, call: Callable[[], object], n: int = N) -> float:
    """Entries the table gains per call of ``call`` (after one call to warm it up). A table that
    resizes meanwhile (the test process's own strings may bring it to its threshold at any time)
    is measured again: its counters start over."""
    call()
    for _ in range(3):
        before = table.counts()
        for _ in range(n):
            call()
        after = table.counts()
        if after.log2_size == before.log2_size:
            return (after.entries - before.entries) / n
    raise AssertionError("the table resized in each of three measurements")


def test_the_reading_counts_strings_interned_and_freed(table: InternedTable) -> None:
    before = table.counts()
    for i in range(100):
        s = sys.intern(f"a string of this test {i}")
        del s
    kept = [sys.intern(f"a string this test keeps {i}") for i in range(10)]
    after = table.counts()
    assert after.log2_size == before.log2_size
    assert after.entries - before.entries == 110  # one entry each, freed or not
    assert after.used - before.used == 10  # only the kept ones are still there
    assert len(kept) == 10


@pytest.fixture
def store(tmp_path: Path, tiny_model: Path) -> Stores:
    """A model file, a sub-folder model (llama.cpp's router layout) and a models.toml entry, whose
    names no ``Path`` of the test holds (an interned name held elsewhere is not interned again)."""
    root = os.path.join(str(tmp_path), "interned-store")
    os.makedirs(os.path.join(root, "folded-model"))
    for name in ("solo-model.gguf", "folded-model/folded-model.gguf", "toml-model.gguf"):
        os.link(str(tiny_model), os.path.join(root, name))
    with open(os.path.join(root, "models.toml"), "w") as f:
        f.write('[models."named"]\npath = "toml-model.gguf"\n')
    return Stores(Path(root))


@pytest.mark.parametrize(
    "what",
    ["found", "found with its tag", "sub-folder", "models.toml entry", "unknown", "list", "digest"],
)
def test_the_model_store_interns_nothing_per_lookup(table: InternedTable, store: Stores, what: str) -> None:
    def unknown() -> None:
        with pytest.raises(Exception, match="not found"):
            store.resolve("no-such-model")

    spec = store.resolve("solo-model")
    calls: dict[str, Callable[[], object]] = {
        "found": lambda: store.resolve("solo-model"),
        "found with its tag": lambda: store.resolve("solo-model:latest"),
        "sub-folder": lambda: store.resolve("folded-model"),
        "models.toml entry": lambda: store.resolve("named"),
        "unknown": unknown,
        "list": store.list,
        "digest": lambda: store.digest(spec),
    }
    assert entries_per_call(table, calls[what]) == 0


@pytest.fixture
def ollama(tmp_path: Path, tiny_model: Path) -> Stores:
    """An Ollama store (manifests and blobs) of two models whose names no live ``Path`` holds."""
    root = os.path.join(str(tmp_path), "interned-ollama")
    add_ollama_model(Path(root), "interned-ollama-model:7b", tiny_model)
    add_ollama_model(Path(root), "someone/interned-other:q8", tiny_model)
    return Stores(Path(root))


@pytest.mark.parametrize("what", ["found", "found in another case", "unknown", "list"])
def test_an_ollama_store_interns_nothing_per_lookup(table: InternedTable, ollama: Stores, what: str) -> None:
    def unknown() -> None:
        with pytest.raises(Exception, match="not found"):
            ollama.resolve("no-such-ollama-model")

    calls: dict[str, Callable[[], object]] = {
        "found": lambda: ollama.resolve("interned-ollama-model:7b"),
        "found in another case": lambda: ollama.resolve("Interned-Ollama-Model:7B"),  # the manifests' walk
        "unknown": unknown,
        "list": ollama.list,
    }
    assert entries_per_call(table, calls[what]) == 0


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_requests_intern_nothing(table: InternedTable, store: Stores) -> None:
    """The requests of a soak, over HTTP to an in-process server with a real llama-server: each
    kind 20 times after a warm-up, and the table gains no entry (the client's work counts too)."""
    chat = [{"role": "user", "content": "tell me a story"}]
    model = "solo-model"
    kinds: dict[str, tuple[str, str, dict[str, object] | None, int]] = {
        "ollama generate": ("POST", "/api/generate", {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 4}}, 200),
        "ollama chat, streamed": ("POST", "/api/chat", {"model": model, "messages": chat, "options": {"num_predict": 4}}, 200),
        "openai chat, streamed": ("POST", "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 4, "stream": True}, 200),
        "anthropic messages": ("POST", "/v1/messages", {"model": model, "messages": chat, "max_tokens": 4}, 200),
        "llama.cpp tokenize": ("POST", "/tokenize", {"model": model, "content": "hi"}, 200),
        "unknown model": ("POST", "/api/generate", {"model": "no-such-model", "prompt": "x", "stream": False}, 404),
        "bad body for a model": ("POST", "/v1/chat/completions", {"model": model, "messages": "not a list"}, 400),
        "sub-folder model": ("POST", "/api/show", {"model": "folded-model"}, 200),
        "tags": ("GET", "/api/tags", None, 200),
        "ps": ("GET", "/api/ps", None, 200),
        "metrics": ("GET", "/metrics", None, 200),
    }
    root = store.folders[0]
    with trio.fail_after(120):
        async with open_test_server(root) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            per_request = {}
            for kind, (method, path, body, status) in kinds.items():
                for _ in range(3):  # warm: the model's load, first-use imports and caches
                    assert (await http.request(method, path, json=body)).status_code == status, kind
                for _ in range(3):  # measured again if the table resized meanwhile
                    before = table.counts()
                    for _ in range(20):
                        await http.request(method, path, json=body)
                    after = table.counts()
                    if after.log2_size == before.log2_size:
                        break
                else:
                    raise AssertionError(f"{kind}: the table resized in each of three measurements")
                per_request[kind] = (after.entries - before.entries) / 20
    # One entry a request is what a name built into a Path per request costs; a background task
    # of the server may intern a string once in a while (not per request)
    assert all(n < 0.5 for n in per_request.values()), per_request
