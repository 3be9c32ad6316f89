"""End to end: a trioshed served in-process, real llama-server children, official clients.

The official ``ollama`` and ``openai`` clients are synchronous here: they run in worker threads
(``trio.to_thread``) while trioshed serves on the test's Trio loop. Real clock, ``fail_after``
guards (simulated time would time out the children's start-up).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import trio

from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 8, "temperature": 0, "seed": 1}


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def test_official_ollama_client(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            client = ollama.Client(host=server.base_url)
            result = await in_thread(client.generate, model="tiny", prompt="hello", options=FAST, stream=False)
            assert result.done and result.done_reason in ("stop", "length")
            assert result.eval_count and result.eval_count > 0 and result.load_duration and result.load_duration > 0

            chunks = await in_thread(lambda: list(client.generate(model="tiny", prompt="hello", options=FAST, stream=True)))
            assert chunks[-1].done and not any(c.done for c in chunks[:-1])
            assert "".join(c.response for c in chunks) == result.response  # temperature 0, same seed

            chat = await in_thread(client.chat, model="tiny", messages=[{"role": "user", "content": "hi"}], options=FAST)
            assert chat.message.role == "assistant" and chat.done

            ps = await in_thread(client.ps)
            assert [m.model for m in ps.models] == ["tiny:latest"]
            assert ps.models[0].size > 0 and ps.models[0].expires_at is not None

            listed = await in_thread(client.list)
            assert [m.model for m in listed.models] == ["tiny:latest"]
            assert listed.models[0].digest and len(listed.models[0].digest) == 64


async def test_official_openai_client(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            reply = await in_thread(
                client.chat.completions.create, model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
            assert reply.model == "tiny" and reply.choices[0].message.role == "assistant"
            stream = await in_thread(
                lambda: list(
                    client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
                    )
                )
            )
            assert stream and stream[-1].choices[0].finish_reason in ("stop", "length")
            assert {c.model for c in stream} == {"tiny"}  # relayed bytes, the model renamed
            models = await in_thread(client.models.list)
            assert [m.id for m in models.data] == ["tiny"]


async def test_errors_are_json_with_the_right_status(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/api/generate", json={"model": "nope", "prompt": "x"})
            assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
            r = await http.post("/api/generate", content=b'{"model": "tiny", ')
            assert r.status_code == 400 and "invalid JSON" in r.json()["error"]
            r = await http.post("/api/chat", json={"model": "../etc/passwd", "messages": []})
            assert r.status_code == 400 and "invalid model name" in r.json()["error"]
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}})
            assert r.status_code == 400 and "temperature" in r.json()["error"]
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": "soon"})
            assert r.status_code == 400 and "keep_alive" in r.json()["error"]
            r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
            assert r.status_code == 404
            assert (await http.get("/")).text == "Ollama is running"
            assert (await http.head("/")).status_code == 200
            assert (await http.get("/api/version")).json()["version"]


def _task_names(task: trio.lowlevel.Task) -> list[str]:
    names = [task.name]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            names += _task_names(child)
    return names


LONG_STREAMS = {
    "/api/generate": {"model": "tiny", "prompt": "hello", "options": {"num_predict": 2000, "temperature": 1}},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2000,
                             "temperature": 1, "stream": True},
}  # fmt: skip


@pytest.mark.parametrize("path", list(LONG_STREAMS))
async def test_client_disconnect_mid_stream_releases_the_lease(model_store: Path, path: str) -> None:
    """The client's departure cancels the request: the connection tells it, with no task per
    request watching for it (one was: a spawn, a switch and a cancel on every request)."""
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with http.stream("POST", path, json=LONG_STREAMS[path]) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                first = await lines.__anext__()
                assert first.strip() and "[DONE]" not in first and '"done":true' not in first
                assert server.scheduler.statistics().leased == 1
                names = _task_names(trio.lowlevel.current_root_task())
                assert any("hypercorn" in name for name in names)  # the walk reaches the server's tasks
                assert not [name for name in names if "Disconnect" in name or "api.pipeline.fast_path" in name]
            # the client hung up: the handler is cancelled and the body gives the lease back
            with trio.fail_after(10):
                stats = await server.scheduler.wait_statistics(lambda s: s.leased == 0)
            assert stats.loaded == 1 and stats.runners[0].leases == 0
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "again", "stream": False, "options": FAST})
            assert r.status_code == 200 and r.json()["done"] is True
            assert server.scheduler.statistics().loads == 1  # the same runner, still usable


SHORT_STREAMS = {
    "/api/generate": {"model": "tiny", "prompt": "hello", "options": FAST},
    "/api/chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": FAST},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True},
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 8, "stream": True},
}  # fmt: skip


async def test_a_streamed_answer_ends_with_its_lease_given_back(model_store: Path) -> None:
    """A stream's end goes out before its body's clean-up (the lease, the runner's connection),
    which runs before the server does anything else: whoever saw the end sees the lease back."""
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for path, body in SHORT_STREAMS.items():
                for _ in range(3):
                    async with http.stream("POST", path, json=body) as response:
                        assert response.status_code == 200
                        text = b"".join([piece async for piece in response.aiter_bytes()])
                        assert server.scheduler.statistics().leased == 0, path
                    assert re.search(rb'"done": ?true|\[DONE\]|message_stop|response\.(?:completed|incomplete)', text), (path, text[-200:])


async def test_empty_prompt_loads_and_keep_alive_zero_unloads(model_store: Path) -> None:
    with trio.fail_after(60):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/api/generate", json={"model": "tiny"})
            assert r.json()["done_reason"] == "load" and server.scheduler.statistics().loaded == 1
            r = await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
            assert r.json()["done_reason"] == "unload"
            assert server.scheduler.statistics().runners == ()
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": 0, "stream": False, "options": FAST})
            assert r.status_code == 200
            with trio.fail_after(10):
                await server.scheduler.wait_statistics(lambda s: not s.runners)


async def test_gemma_answers_deterministically(gemma_store: Path) -> None:
    store = gemma_store
    with trio.fail_after(240):
        async with open_test_server(store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            # The demo model is a base model without a chat template: generate sends the prompt
            # as it is (Ollama's default template), and it continues it.
            body = {"model": "gemma3-270m", "prompt": "The capital of France is", "stream": False,
                    "options": {"temperature": 0, "num_predict": 24}}  # fmt: skip
            first = (await http.post("/api/generate", json=body)).json()
            second = (await http.post("/api/generate", json=body)).json()
            assert first["response"].strip(), first
            assert first["response"] == second["response"]
            assert first["load_duration"] > 0 and second["load_duration"] == 0
            assert first["eval_count"] > 0 and first["prompt_eval_count"] > 0 and first["total_duration"] > 0
            words = first["response"].split()
            assert len(words) >= 5 and "<" not in first["response"], first["response"]


async def test_embeddings_with_official_clients_and_no_reload_for_chat_after(model_store: Path) -> None:
    with trio.fail_after(120):
        async with open_test_server(model_store) as server:
            client = ollama.Client(host=server.base_url)
            result = await in_thread(client.embed, model="tiny", input=["hello", "world"])
            assert len(result.embeddings) == 2 and len(result.embeddings[0]) == 64  # n_embd
            norm = sum(x * x for x in result.embeddings[0]) ** 0.5
            assert abs(norm - 1.0) < 1e-3  # normalized, as Ollama's
            legacy = await in_thread(client.embeddings, model="tiny", prompt="hello")
            assert len(legacy.embedding) == 64
            oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            vectors = await in_thread(oai.embeddings.create, model="tiny", input="hello")
            assert vectors.model == "tiny" and len(vectors.data[0].embedding) == 64
            # the embedding runner generates too: no reload
            await in_thread(client.generate, model="tiny", prompt="hi", options=FAST)
            assert server.scheduler.statistics().loads == 1


async def test_chat_with_a_template_less_base_model_reads_as_a_transcript(gemma_store: Path) -> None:
    store = gemma_store
    with trio.fail_after(240):
        async with open_test_server(store) as server:
            client = ollama.Client(host=server.base_url)
            reply = await in_thread(
                client.chat,
                model="gemma3-270m",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                options={"temperature": 0, "num_predict": 24},
            )
            content = reply.message.content
            assert content.strip() and "<|im" not in content and "User:" not in content, content
            assert reply.done_reason in ("stop", "length")
            # The same conversation through OpenAI's API, whole and streamed: chat's shape, the
            # transcript underneath (not llama-server's ChatML fallback, which echoes markup).
            oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            question = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
            whole = await in_thread(
                oai.chat.completions.create, model="gemma3-270m", messages=question, temperature=0, max_tokens=24
            )
            answer = whole.choices[0].message.content or ""
            assert whole.object == "chat.completion" and whole.model == "gemma3-270m"
            assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
            assert answer.strip() and "<|im" not in answer and "User:" not in answer, answer
            assert answer.strip() == content.strip()  # the same transcript as Ollama's chat

            def streamed() -> tuple[str, list[str]]:
                chunks = list(oai.chat.completions.create(
                    model="gemma3-270m", messages=question, temperature=0, max_tokens=24, stream=True
                ))  # fmt: skip
                objects = {c.object for c in chunks}
                assert objects == {"chat.completion.chunk"} and chunks[0].choices[0].delta.role == "assistant"
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return text, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

            text, reasons = await in_thread(streamed)
            assert text == answer and reasons == [whole.choices[0].finish_reason]


async def test_a_responses_stream_numbers_its_events_in_the_order_they_are_sent(model_store: Path) -> None:
    """``sequence_number`` counts the Responses events as the client gets them, from 0: the
    response's opening events first, then the answer's (they were numbered after the answer's
    first piece, which was read first, and went out first)."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "stream": True, "temperature": 0}
    with trio.fail_after(120):
        async with open_test_server(model_store) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for _ in range(5):
                r = await http.post("/v1/responses", json=body)
                assert r.status_code == 200, r.text
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed", "response.incomplete")
                assert [e["sequence_number"] for e in events] == list(range(len(events))), [e["type"] for e in events]
