"""What a request that sets no sampling parameter samples with, read from the real runner's own
view of it (llama-server's ``/slots``: the parameters of the slot's last task), on every
protocol: Ollama's routes Ollama's ``DefaultOptions``, OpenAI's and Anthropic's their APIs'
documented defaults, never llama-server's own (top_p 0.95, min_p 0.05). And a model's options
(``models.toml``) under a request's own on every protocol, OpenAI's routes included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioshed.api.protocols import sampling
from trioshed.testing.server import Server, open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

#: llama-server's own defaults (b10068), which no protocol's request may get.
LLAMA = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "n_keep": 0}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    write_tiny_model(store / "chat.gguf")  # a chat template (ChatML)
    write_tiny_model(store / "base.gguf", chat_template="")  # none: the transcript path
    (store / "models.toml").write_text(
        '[models.capped]\npath = "chat.gguf"\noptions = { num_predict = 3, temperature = 0.5, top_k = 7, stop = ["zzz"] }\n'
        '[models.capped-base]\npath = "base.gguf"\noptions = { num_predict = 3, temperature = 0.5, top_k = 7 }\n'
        '[models.stopped-base]\npath = "base.gguf"\noptions = { stop = ["zzz"] }\n'
    )
    return store


async def _slot_params(server: Server) -> dict[str, Any]:
    """The sampling parameters of the last task the one runner served, as llama-server holds them."""
    (runner,) = server.scheduler.statistics().runners
    assert runner.upstream is not None
    status, raw = await runner.upstream.get("/slots")
    assert status == 200, raw
    last = max(json.loads(raw), key=lambda slot: slot["id_task"])
    return dict(last["params"])


def _close(params: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """``params``' values for ``expected``'s keys, rounded as llama-server's floats are."""
    return {k: round(params[k], 4) if isinstance(params[k], float) else params[k] for k in expected}


#: (route, body without any sampling parameter: only a length, which is not one)
OLLAMA = [
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": 2}}),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 2}}),
]
OPENAI = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
]
ANTHROPIC = [("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


@pytest.mark.parametrize(
    ("protocol", "cases", "expected"),
    [("ollama", OLLAMA, sampling.OLLAMA), ("openai", OPENAI, sampling.OPENAI), ("anthropic", ANTHROPIC, sampling.ANTHROPIC)],
)
async def test_a_request_without_options_samples_with_its_protocols_defaults(
    store: Path, protocol: str, cases: list[tuple[str, dict[str, Any]]], expected: dict[str, Any]
) -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    with trio.fail_after(180):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for model in ("chat", "base"):  # the template's path and the transcript's
                for route, body in cases:
                    for stream in (False, True):
                        r = await http.post(route, json={**body, "model": model, "stream": stream})
                        assert r.status_code == 200, r.text
                        seen.append((model, f"{route} stream={stream}", _close(await _slot_params(server), expected)))
                await http.post("/api/generate", json={"model": model, "keep_alive": 0})
    want = _close(dict(expected), expected)
    assert [(m, route, params) for m, route, params in seen if params != want] == []
    assert any(want[k] != v for k, v in LLAMA.items() if k in want)  # not what llama-server would do alone


async def test_a_models_options_apply_on_openais_routes_under_the_requests_own(store: Path) -> None:
    """``models.toml``'s ``num_predict``, ``temperature`` and ``top_k`` reach the runner on every
    OpenAI route (and the transcript path), the request's own win, and OpenAI's defaults fill the
    rest; the answer stops at the model's length."""
    got: dict[str, Any] = {}
    with trio.fail_after(180):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for model in ("capped", "capped-base"):
                for route, body in [
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                    ("/v1/completions", {"prompt": "hi"}),
                    ("/v1/responses", {"input": "hi"}),
                ]:
                    r = await http.post(route, json={**body, "model": model})
                    assert r.status_code == 200, r.text
                    usage = r.json()["usage"]
                    params = await _slot_params(server)
                    got[f"{model} {route}"] = (params["n_predict"], round(params["temperature"], 4), params["top_k"], params["top_p"],
                                               usage.get("completion_tokens", usage.get("output_tokens")) <= 3)  # fmt: skip
                    own = {"max_output_tokens": 2} if route == "/v1/responses" else {"max_tokens": 2}
                    r = await http.post(route, json={**body, "model": model, "temperature": 0.25, "top_k": 5, **own})
                    assert r.status_code == 200, r.text
                    params = await _slot_params(server)
                    got[f"{model} {route} own"] = (params["n_predict"], round(params["temperature"], 4), params["top_k"], params["top_p"], True)
                await http.post("/api/generate", json={"model": model, "keep_alive": 0})
    for key, value in got.items():
        if key.endswith(" own"):
            assert value == (2, 0.25, 5 if "/v1/responses" not in key else 7, 1.0, True), key
        else:
            assert value == (3, 0.5, 7, 1.0, True), key



def _answer(route: str, data: dict[str, Any]) -> str:
    if route == "/api/chat":
        return str(data["message"]["content"])
    if route == "/v1/messages":
        return "".join(block.get("text", "") for block in data["content"])
    return str(data["choices"][0]["message"]["content"])


@pytest.mark.parametrize("model", ["base", "chat"])
async def test_a_models_stop_applies_on_every_protocol_unless_the_request_names_its_own(store: Path, model: str) -> None:
    """A model's own ``stop`` (models.toml) ends its answer where it appears on every protocol's
    chat route, with a chat template and without one (where the transcript's next turn is a stop
    too); a request's own stop sequences replace the model's, as on Ollama's routes. (Seen in the
    answers: llama-server's /slots does not show a task's stops.)"""
    hi = [{"role": "user", "content": "hi"}]
    cases = {
        "/api/chat": lambda stop: {"messages": hi, "options": {"num_predict": 24, "temperature": 0, **stop}},
        "/v1/chat/completions": lambda stop: {"messages": hi, "max_tokens": 24, "temperature": 0, **stop},
        "/v1/messages": lambda stop: {"messages": hi, "max_tokens": 24, "temperature": 0,
                                      **({"stop_sequences": stop["stop"]} if stop else {})},
    }  # fmt: skip
    with trio.fail_after(180):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            whole: dict[str, str] = {}
            for route, body in cases.items():
                r = await http.post(route, json={**body({}), "model": model, "stream": False})
                assert r.status_code == 200, r.text
                whole[route] = _answer(route, r.json())
            # each route's stop: the last piece of its whole answer that is first seen where it stands
            stops = {}
            for route, text in whole.items():
                at = max(i for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i)
                stops[route] = (text[at : at + 2], at)
            (store / "models.toml").write_text((store / "models.toml").read_text() + "".join(
                f'[models.stop{n}]\npath = "{model}.gguf"\noptions = {{ stop = [{json.dumps(stop)}] }}\n'
                for n, (stop, _) in enumerate(stops.values())))  # fmt: skip
            for n, (route, body) in enumerate(cases.items()):
                stop, at = stops[route]
                r = await http.post(route, json={**body({}), "model": f"stop{n}", "stream": False})
                assert r.status_code == 200, r.text
                assert _answer(route, r.json()) == whole[route][:at], (route, stop, whole[route])
                r = await http.post(route, json={**body({"stop": ["never-seen"]}), "model": f"stop{n}", "stream": False})
                assert r.status_code == 200, r.text
                assert _answer(route, r.json()) == whole[route], route  # the request's own replace the model's


async def test_a_greedy_request_keeps_llama_servers_own_cuts_unless_it_asks_for_probabilities(store: Path) -> None:
    """At temperature 0 on OpenAI's and Anthropic's routes the cuts that are off (top_k 0, top_p 1,
    min_p 0) are not sent: the runner keeps its own, as llama-server alone with the same body
    (the same argmax, without a pass over the whole vocabulary each step); a request that asks for
    log probabilities still gets the protocol's."""
    cuts = {k: LLAMA[k] for k in ("top_k", "top_p", "min_p")}
    seen: dict[str, dict[str, Any]] = {}
    with trio.fail_after(180):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for model in ("chat", "base"):
                for route, body in [*OPENAI, *ANTHROPIC]:
                    r = await http.post(route, json={**body, "model": model, "temperature": 0})
                    assert r.status_code == 200, r.text
                    seen[f"{model} {route}"] = _close(await _slot_params(server), cuts)
                asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 2}
                r = await http.post("/v1/chat/completions", json={**asked, "model": model})
                assert r.status_code == 200, r.text
                seen[f"{model} logprobs"] = _close(await _slot_params(server), cuts)
                await http.post("/api/generate", json={"model": model, "keep_alive": 0})
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert {k: v for k, v in seen.items() if "logprobs" not in k and v != cuts} == {}
    assert seen["chat logprobs"] == off and seen["base logprobs"] == off
