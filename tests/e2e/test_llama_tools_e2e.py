"""End to end: llama-server's /infill, /tokenize, /detokenize, /apply-template and the
/upstream/<model>/<path> pass-through, through trioshed and against the same llama-server run
alone with the runner's own command line (the same binary, model and options)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import session_llama_servers
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import FIM_IDS, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

INFILL = {"input_prefix": "def f(", "input_suffix": "return x\n", "n_predict": 6, "temperature": 0, "seed": 1}
#: What may differ between two runs of the same request: times, the slot, the cache's state and
#: the name the model goes by.
VOLATILE = ("timings", "model", "id_slot", "tokens_cached")


@pytest.fixture
def fim_store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    write_tiny_model(store / "fim.gguf", fim=True)
    write_tiny_model(store / "plain.gguf")
    return store


def _runner_argv() -> list[str]:
    """The command line of the one runner this test's trioshed started, less where it listens
    and its secret: what to run alone."""
    (proc,) = [p for p in session_llama_servers() if p.is_running()]
    argv, out, skip = proc.cmdline(), [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg in ("--port", "--host", "--api-key", "--model", "-m"):
            skip = True
        else:
            out.append(arg)
    return out


def _stable(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in VOLATILE}


def _events(text: str) -> list[dict[str, Any]]:
    return [_stable(json.loads(line[6:])) for line in text.splitlines() if line.startswith("data: {")]


async def test_each_route_answers_what_llama_server_alone_answers(fim_store: Path) -> None:
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/infill", INFILL),
        ("/infill", {**INFILL, "input_extra": [{"filename": "a.py", "text": "x = 1\n"}], "prompt": "a", "n_probs": 2}),
        ("/tokenize", {"content": "hi <fim_prefix>", "with_pieces": True}),
        ("/tokenize", {"content": "hi <fim_prefix>", "add_special": True, "parse_special": True}),
        ("/detokenize", {"tokens": [105, 106, *FIM_IDS]}),
        ("/apply-template", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ]
    with trio.fail_after(120):
        async with open_test_server(fim_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            ours = []
            for path, body in bodies:
                r = await client.post(path, json={"model": "fim", **body})
                assert r.status_code == 200, r.text
                ours.append(r.json())
            streamed = await client.post("/infill", json={"model": "fim", **INFILL, "stream": True})
            assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
            via_upstream = await client.post("/upstream/fim/infill", json=INFILL)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True}
            upstream_stream = await client.post("/upstream/fim/v1/chat/completions", json=chat)
            assert upstream_stream.headers["content-type"].startswith("text/event-stream")
            props = await client.get("/upstream/fim/props")
            head = await client.head("/upstream/fim/health")
            assert head.status_code == 200 and head.content == b""
            argv = _runner_argv()
    assert ours[0]["model"] == "fim" and ours[0]["content"] and ours[0]["stop"] is True
    assert ours[2]["tokens"][-1] == {"id": FIM_IDS[0], "piece": "<fim_prefix>"}
    assert props.status_code == 200 and props.json()["model_path"] == "fim"  # never the file's path
    assert str(fim_store) not in props.text

    def alone() -> tuple[list[dict[str, Any]], str, dict[str, Any], str]:
        with running_llama_server(fim_store / "fim.gguf", argv) as server:
            answers = [httpx.post(server.url + path, json=body, timeout=60).json() for path, body in bodies]
            stream = httpx.post(server.url + "/infill", json={**INFILL, "stream": True}, timeout=60).text
            chat_stream = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).text
            return answers, stream, httpx.get(server.url + "/props").json(), chat_stream

    theirs, stream, their_props, their_chat = await trio.to_thread.run_sync(alone)
    for (path, _), mine, reference in zip(bodies, ours, theirs, strict=True):
        assert _stable(mine) == _stable(reference), path
    assert _events(streamed.text) == _events(stream)
    assert _stable(via_upstream.json()) == _stable(theirs[0])
    texts = [[e["choices"][0]["delta"].get("content") for e in map(json.loads, (x[6:] for x in t.splitlines() if x.startswith("data: {"))) if e["choices"]]
             for t in (upstream_stream.text, their_chat)]  # fmt: skip
    assert texts[0] == texts[1] and len(texts[0]) > 2
    per_process = ("model_path", "media_marker")  # the file's path is hidden; the marker is random per process
    assert {k: v for k, v in props.json().items() if k not in per_process} == {k: v for k, v in their_props.items() if k not in per_process}


async def _nothing_loaded(client: httpx.AsyncClient) -> None:
    assert (await client.get("/api/ps")).json()["models"] == []


async def test_bad_input_gets_a_4xx_in_llama_cpp_shape_with_nothing_loaded(fim_store: Path) -> None:
    cases: list[tuple[str, Any, int, str]] = [
        ("/infill", {"model": "plain", **INFILL}, 400, "does not support insert"),
        ("/infill", {"model": "nope", **INFILL}, 404, "not found"),
        ("/infill", {**INFILL}, 400, '"model" is required'),
        ("/infill", {"model": "fim", "input_prefix": 3}, 400, '"input_prefix" must be a string'),
        ("/infill", {"model": "fim", "input_extra": [{"text": 1}]}, 400, "input_extra[0]"),
        ("/infill", {"model": "fim", "n_predict": "8"}, 400, '"n_predict" must be an integer'),
        ("/infill", [1, 2], 400, "JSON object"),
        ("/tokenize", {"model": "fim", "content": 5}, 400, '"content" must be a string'),
        ("/tokenize", {"model": 7, "content": "x"}, 400, '"model" is required'),
        ("/detokenize", {"model": "fim", "tokens": "x"}, 400, '"tokens" must be a list'),
        ("/detokenize", {"model": "fim", "tokens": [1, -1]}, 400, "token ids"),
        ("/detokenize", {"model": "fim", "tokens": [135]}, 400, "outside the model's vocabulary of 135"),
        ("/apply-template", {"model": "fim", "messages": []}, 400, '"messages" is required'),
        ("/apply-template", {"model": "fim", "messages": ["hi"]}, 400, "messages[0]"),
        ("/apply-template", {"model": "fim", "options": {"num_ctx": 0}}, 400, "num_ctx"),
    ]
    with trio.fail_after(60):
        async with open_test_server(fim_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            for path, body, status, words in cases:
                r = await client.post(path, json=body)
                assert r.status_code == status, (path, body, r.text)
                error = r.json()["error"]
                assert error["code"] == status and words in error["message"] and error["type"], (path, body, error)
            r = await client.post("/tokenize", content=b"{not json", headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            await _nothing_loaded(client)


async def test_upstream_refuses_what_it_must_not_forward_with_nothing_loaded(fim_store: Path) -> None:
    posts = [
        ("/upstream/fim/slots/0?action=save", {"filename": "x.bin"}, 403),
        ("/upstream/fim/slots/0?action=restore", {"filename": "../../etc/passwd"}, 403),
        ("/upstream/fim/props", {"default_generation_settings": {}}, 403),
        ("/upstream/fim/lora-adapters", [{"id": 0, "scale": 1}], 403),
        ("/upstream/fim/models/load", {"model": "x"}, 403),
        ("/upstream/nope/completion", {"prompt": "x"}, 404),
        ("/upstream/fim/completion", [1], 400),
    ]
    raw_paths = ["/upstream/fim/../props", "/upstream/fim/%2e%2e/props", "/upstream/fim%2Fprops", "/upstream/fim/%5Cprops", "/upstream/fim//props"]
    with trio.fail_after(60):
        async with open_test_server(fim_store, api_key="sesame") as server:
            headers = {"Authorization": "Bearer sesame"}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30, headers=headers) as client:
                for path, body, status in posts:
                    r = await client.post(path, json=body)
                    assert r.status_code == status, (path, r.text)
                    assert r.json()["error"]["code"] == status
                for method in ("PUT", "DELETE", "PATCH"):
                    assert (await client.request(method, "/upstream/fim/completion")).status_code == 405
                assert (await client.get("/upstream/fim/slots")).status_code == 403
                assert (await client.get("/upstream/fim/metrics")).status_code == 403
                for raw in raw_paths:  # sent as written: no client-side normalisation
                    r = await client.get(httpx.URL(server.base_url + "/").copy_with(raw_path=raw.encode()))
                    assert r.status_code in (400, 404), (raw, r.status_code, r.text)
                await _nothing_loaded(client)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as anonymous:
                assert (await anonymous.get("/upstream/fim/health")).status_code == 401
                assert (await anonymous.post("/infill", json={"model": "fim", **INFILL})).status_code == 401
                r = await anonymous.get("/upstream/fim/health", headers={**headers, "Origin": "https://evil.example"})
                assert r.status_code == 403
                r = await anonymous.post("/tokenize", json={"model": "fim", "content": "x"}, headers={**headers, "Host": "evil.example"})
                assert r.status_code == 403
                async with httpx.AsyncClient(base_url=server.base_url, timeout=30, headers=headers) as client:
                    await _nothing_loaded(client)


async def test_ollamas_suffix_fills_in_the_middle_as_infill_does(fim_store: Path) -> None:
    import ollama

    with trio.fail_after(60):
        async with open_test_server(fim_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            sdk = ollama.Client(host=server.base_url)
            options = {"num_predict": 6, "temperature": 0, "seed": 1}
            filled = await trio.to_thread.run_sync(lambda: sdk.generate(model="fim", prompt="def f(", suffix="return x\n", options=options))
            infill = (await client.post("/infill", json={"model": "fim", **INFILL})).json()
            assert filled.response == infill["content"] and filled.eval_count == infill["tokens_predicted"] == 6
            with pytest.raises(ollama.ResponseError) as caught:
                await trio.to_thread.run_sync(lambda: sdk.generate(model="plain", prompt="def f(", suffix="x", options=options))
            assert caught.value.status_code == 400 and "does not support insert" in caught.value.error
            assert [m["name"] for m in (await client.get("/api/ps")).json()["models"]] == ["fim:latest"]


async def test_the_routes_lease_like_any_request_and_set_the_keep_alive(fim_store: Path) -> None:
    from datetime import UTC, datetime, timedelta

    async def expires(client: httpx.AsyncClient) -> timedelta:
        (model,) = (await client.get("/api/ps")).json()["models"]
        return datetime.fromisoformat(model["expires_at"].replace("Z", "+00:00")) - datetime.now(UTC)

    with trio.fail_after(60):
        async with open_test_server(fim_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            assert (await client.get("/upstream/fim/health")).status_code == 200  # a read loads the model too
            assert timedelta(minutes=4) < await expires(client) <= timedelta(minutes=5)  # the default keep-alive
            r = await client.post("/tokenize", json={"model": "fim", "content": "x", "keep_alive": "2h"})
            assert r.status_code == 200 and r.json() == {"tokens": [131, 123]}
            assert timedelta(minutes=119) < await expires(client) <= timedelta(hours=2)
            r = await client.post("/apply-template", json={"model": "fim", "messages": [{"role": "user", "content": "x"}], "keep_alive": "30m"})
            assert r.status_code == 200 and timedelta(minutes=29) < await expires(client) <= timedelta(minutes=30)
            metrics = (await client.get("/metrics")).text
            waits = {line.split("{")[1].split("}")[0]: line.rsplit(" ", 1)[1] for line in metrics.splitlines()
                     if line.startswith("trioshed_queue_wait_seconds_count")}  # fmt: skip
            assert waits['model="fim:latest",route="/tokenize"'] == "1.0"  # through the scheduler, counted
            assert waits['model="fim:latest",route="/apply-template"'] == "1.0"
            assert waits['model="fim:latest",route="/upstream/<path:rest>"'] == "1.0"


async def test_a_stream_llama_server_refuses_answers_its_status_before_any_event(fim_store: Path) -> None:
    too_long = {"prompt": "ab " * 400, "n_predict": 4, "stream": True}  # ~1,200 tokens for a 256-token context
    with trio.fail_after(60):
        async with open_test_server(fim_store, context_length=256) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            r = await client.post("/upstream/fim/completion", json=too_long)
            ok = await client.post("/upstream/fim/completion", json={**too_long, "prompt": "ab"})
            argv = _runner_argv()
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "context" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/event-stream") and '"stop":true' in ok.text

    def alone() -> int:
        with running_llama_server(fim_store / "fim.gguf", argv) as server:
            return httpx.post(server.url + "/completion", json=too_long, timeout=60).status_code

    assert await trio.to_thread.run_sync(alone) == r.status_code


async def test_gemma_tokenizes_and_renders_its_template_as_llama_server_alone(gemma_store: Path) -> None:
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"content": "Héllo <start_of_turn> wörld 🙂", "with_pieces": True}),
        ("/tokenize", {"content": "Héllo <start_of_turn>", "add_special": True, "parse_special": True}),
        ("/detokenize", {"tokens": [2, 9259, 106, 236743]}),
        ("/apply-template", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]}),
    ]  # fmt: skip
    with trio.fail_after(180):
        async with open_test_server(gemma_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            ours = [(await client.post(path, json={"model": "gemma3-270m", **body})).json() for path, body in bodies]
            argv = _runner_argv()
            infill = await client.post("/infill", json={"model": "gemma3-270m", **INFILL})
    assert ours[3]["prompt"].endswith("Why?<|im_end|>\n<|im_start|>assistant\n")  # no template in this GGUF: llama-server's ChatML
    # gemma3 has no fill-in-the-middle tokens
    assert infill.status_code == 400 and "does not support insert" in infill.json()["error"]["message"], infill.text

    def alone() -> list[dict[str, Any]]:
        with running_llama_server(_gemma_path(gemma_store), argv) as server:
            return [httpx.post(server.url + path, json=body, timeout=60).json() for path, body in bodies]

    assert ours == await trio.to_thread.run_sync(alone)


def _gemma_path(store: Path) -> str:
    import tomllib

    return str(tomllib.loads((store / "models.toml").read_text())["models"]["gemma3-270m"]["path"])


async def test_upstream_finds_model_names_with_slashes(fim_store: Path, tmp_path: Path) -> None:
    import os

    from trioshed.testing.ollama_store import add_ollama_model

    ollama_root = tmp_path / "ollama"
    add_ollama_model(ollama_root, "someone/coder:v1", fim_store / "fim.gguf", params={"temperature": 0})
    with trio.fail_after(60):
        async with open_test_server(f"{fim_store}{os.pathsep}{ollama_root}") as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:  # type: ignore[arg-type]
            r = await client.post("/upstream/someone/coder:v1/tokenize", json={"content": "hi"})
            assert r.status_code == 200 and r.json() == {"tokens": [131, 107, 108]}
            r = await client.post("/upstream/someone/coder:v1/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
            assert (await client.post("/upstream/someone/nobody:v1/tokenize", json={"content": "hi"})).status_code == 404
            assert (await client.post("/upstream/someone/coder:v1/slots/0", json={})).status_code == 403
            r = await client.post("/infill", json={"model": "someone/coder:v1", **INFILL})
            assert r.status_code == 200 and r.json()["model"] == "someone/coder:v1"


@pytest.mark.parametrize("path", ["/infill", "/upstream/fim/completion"])
async def test_a_client_that_leaves_mid_stream_gives_the_lease_back(fim_store: Path, path: str) -> None:
    body = {"input_prefix": "a", "input_suffix": "b", "prompt": "c", "n_predict": 2000, "stream": True}
    body |= {"model": "fim"} if path == "/infill" else {}
    with trio.fail_after(60):
        async with open_test_server(fim_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                first = await response.aiter_lines().__anext__()
                assert first.startswith("data: {") and server.scheduler.statistics().leased == 1
            with trio.fail_after(10):
                stats = await server.scheduler.wait_statistics(lambda s: s.leased == 0)
            assert stats.loaded == 1 and stats.runners[0].leases == 0
            r = await client.post("/tokenize", json={"model": "fim", "content": "hi"})
            assert r.status_code == 200 and server.scheduler.statistics().loads == 1  # the same runner serves on
