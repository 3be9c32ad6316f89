"""GET /openapi.json: valid OpenAPI 3.1, and true to the app's url map in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import trio
from openapi_schema_validator import OAS31Validator
from openapi_schema_validator import validate as validate_instance
from openapi_spec_validator import validate

from trioshed.api.app import create_app
from trioshed.api.openapi.document import document
from trioshed.api.protocols.options import RUNNER_OPTION_KEYS, SAMPLING_OPTION_NAMES
from trioshed.api.state import AppState
from trioshed.config import Settings
from trioshed.devices import DeviceSource
from trioshed.errors import BadRequest, ModelNotFound
from trioshed.models.store import ModelStore
from trioshed.models.stores import Stores
from trioshed.runner.binary import LlamaBinary
from trioshed.server import build_scheduler
from trioshed.testing.server import open_test_server

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def served_operations(tmp_path: Path) -> set[tuple[str, str]]:
    """(OpenAPI path, method) for every url rule of the app, without what Quart adds by itself
    (OPTIONS everywhere, HEAD beside GET)."""
    settings = Settings(models=tmp_path)
    scheduler = build_scheduler(settings, DeviceSource((), "cpu"), LlamaBinary("/bin/false", {}))
    app = create_app(AppState(settings=settings, store=ModelStore(tmp_path), scheduler=scheduler))
    ops = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        methods = set(rule.methods or ()) - {"OPTIONS"}
        if "GET" in methods:
            methods.discard("HEAD")
        ops |= {(path, m.lower()) for m in methods}
    return ops


def documented_operations() -> set[tuple[str, str]]:
    ops = set()
    for path, item in document()["paths"].items():
        methods = set(item) & HTTP_METHODS
        if "get" in methods:
            methods.discard("head")  # HEAD beside GET is Quart's own; documenting it is optional
        ops |= {(path, m) for m in methods}
    return ops


def test_every_served_route_is_documented_and_nothing_else(tmp_path: Path) -> None:
    served, documented = served_operations(tmp_path), documented_operations()
    assert served - documented == set(), "served but not in trioshed/api/openapi/document.py"
    assert documented - served == set(), "documented but not served"


def test_the_document_is_valid_openapi_3_1() -> None:
    spec = document()
    assert spec["openapi"] == "3.1.0"
    validate(spec)  # openapi-spec-validator: raises on any schema violation or dangling $ref


def test_request_schemas_say_what_the_routes_check() -> None:
    schemas = document()["components"]["schemas"]
    options = schemas["Options"]
    assert options["type"] == "object"
    assert set(SAMPLING_OPTION_NAMES) | RUNNER_OPTION_KEYS <= set(options["properties"])
    for name in ("GenerateRequest", "ChatRequest", "EmbedRequest", "OpenAIChatRequest", "OpenAIEmbeddingRequest"):
        assert "model" in schemas[name]["required"], name
        assert schemas[name]["properties"]["model"] == {"$ref": "#/components/schemas/ModelName"}, name
        assert schemas[name]["properties"]["options"] == {"$ref": "#/components/schemas/Options"}, name
    assert schemas["ModelName"]["type"] == "string"
    assert schemas["ChatRequest"]["properties"]["messages"]["type"] == "array"
    assert schemas["Message"]["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]
    for path, item in document()["paths"].items():
        for method, op in item.items():
            if method == "post" and path.startswith(("/api/generate", "/api/chat", "/api/embed", "/v1/")):
                content = op["requestBody"]["content"]
                if "multipart/form-data" in content:  # an upload: OpenAI's audio transcriptions
                    assert {"file", "model"} <= set(content["multipart/form-data"]["schema"]["required"]), path
                else:
                    assert content["application/json"]["schema"]["$ref"], path
                assert "400" in op["responses"] and "200" in op["responses"], path


async def test_openapi_json_is_served(model_store: Path, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == document(ollama_names=False)
    ollama = tmp_path / "ollama"
    for path in (ollama / "manifests", ollama / "blobs"):
        path.mkdir(parents=True)
    with trio.fail_after(30):
        async with open_test_server(Path(f"{model_store}:{ollama}")) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.get("/openapi.json")
    assert r.json() == document(ollama_names=True) != document(ollama_names=False)


def response_schema(path: str, method: str, status: int) -> dict[str, object]:
    """The documented JSON schema of an answer, with the components it refers to."""
    spec = document()
    schema = spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]
    return {**schema, "components": spec["components"]}


async def test_answers_match_their_documented_schemas(model_store: Path) -> None:
    cases = [
        ("get", "/api/tags", "/api/tags", None, 200),
        ("get", "/api/ps", "/api/ps", None, 200),
        ("get", "/api/version", "/api/version", None, 200),
        ("post", "/api/show", "/api/show", {"model": "tiny"}, 200),
        ("post", "/api/show", "/api/show", {"model": "nope"}, 404),
        ("post", "/api/generate", "/api/generate", {"model": "tiny", "prompt": "x", "options": [1]}, 400),
        ("get", "/v1/models", "/v1/models", None, 200),
        ("get", "/v1/models/{model}", "/v1/models/tiny", None, 200),
        ("get", "/v1/models/{model}", "/v1/models/nope", None, 404),
        ("post", "/v1/chat/completions", "/v1/chat/completions", {"model": "nope", "messages": []}, 404),
        ("post", "/api/pull", "/api/pull", {"model": "../x"}, 400),
        ("post", "/v1/messages", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, 200),
        ("post", "/v1/messages", "/v1/messages", {"model": "nope", "max_tokens": 2, "messages": []}, 404),
        ("post", "/v1/messages", "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400),
        ("post", "/v1/messages/count_tokens", "/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 200),
    ]
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            for method, path, url, body, status in cases:
                r = await http.request(method.upper(), url, json=body)
                assert r.status_code == status, (url, r.text)
                validate_instance(r.json(), response_schema(path, method, status), cls=OAS31Validator)


@pytest.mark.parametrize(
    "name",
    ["tiny", "tiny:latest", "user/model:tag", "registry.ollama.ai/library/llama3.2:1b", "localhost:5000/ns/m",
     " tiny ", "x:", "", "/x", "a b", "é", "a/b/c/d", "-x", "../x", "a:b:c", "a/../b"],
)  # fmt: skip
@pytest.mark.parametrize("with_ollama_store", [False, True])
def test_the_model_name_pattern_is_what_the_stores_accept(tmp_path: Path, name: str, with_ollama_store: bool) -> None:
    folder, ollama = tmp_path / "folder", tmp_path / "ollama"
    for path in (folder, ollama / "manifests", ollama / "blobs"):
        path.mkdir(parents=True)
    try:
        Stores(f"{folder}:{ollama}" if with_ollama_store else str(folder)).resolve(name)
    except ModelNotFound:
        accepted = True
    except BadRequest:
        accepted = False
    pattern = document(with_ollama_store)["components"]["schemas"]["ModelName"]["pattern"]
    assert (re.match(pattern, name) is not None) == accepted


async def test_documented_security_is_what_the_api_key_guards(model_store: Path) -> None:
    """With TRIOSHED_API_KEY set, an operation documented with ``security: []`` answers without
    the key, and every other documented operation answers 401 (a 401 it documents)."""
    spec = document()
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key="s3cret") as server, httpx.AsyncClient(base_url=server.base_url) as http:
            for path, item in spec["paths"].items():
                url = path.replace("{digest}", "sha256-" + "0" * 64).replace("{model}", "tiny")
                for method, op in item.items():
                    if method not in HTTP_METHODS:
                        continue
                    r = await http.request(method.upper(), url, json={"model": "tiny"} if method in ("post", "delete") else None)
                    if op.get("security") == []:
                        assert r.status_code != 401, (method, path)
                    else:
                        assert r.status_code == 401 and "401" in op["responses"], (method, path, r.status_code)


async def test_an_undocumented_method_is_405_with_allow(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.request("TRACE", "/api/ps")
            chat = await http.delete("/api/chat")
    assert r.status_code == 405 and set(r.headers["Allow"].split(", ")) >= {"GET", "HEAD"} and "error" in r.json()
    assert chat.status_code == 405 and "POST" in chat.headers["Allow"]
