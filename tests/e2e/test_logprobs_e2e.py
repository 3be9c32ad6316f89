"""End to end: log-probabilities through the official ``ollama`` and ``openai`` clients, streamed
and whole, on a model with a chat template and on a base model (the transcript path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

FAST = {"num_predict": 4, "temperature": 0, "seed": 1}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    write_tiny_model(folder / "tiny.gguf")
    write_tiny_model(folder / "base.gguf", chat_template="")  # no template: the transcript path
    return folder


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def _ollama_entries(entries: Any, top: int) -> list[tuple[str, float]]:
    assert entries, "no logprobs"
    for e in entries:
        assert isinstance(e.logprob, float) and e.logprob <= 0
        assert len(e.top_logprobs or []) == top
        if top:
            assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
    return [(e.token, round(e.logprob, 3)) for e in entries]


def _shown(tokens: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The entries a stream carries: llama-server's streamed chat skips a token that shows no
    text (a piece of a character), which its whole answer lists with an empty ``token``."""
    return [t for t in tokens if t[0]]


@pytest.mark.parametrize("model", ["tiny", "base"])
async def test_ollama_client_reads_logprobs_streamed_and_whole(store: Path, model: str) -> None:
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            client = ollama.Client(host=server.base_url)
            whole = await in_thread(client.generate, model=model, prompt="hi", options=FAST, logprobs=True, top_logprobs=2)
            tokens = _ollama_entries(whole.logprobs, 2)
            assert "".join(t for t, _ in tokens) == whole.response and len(tokens) == whole.eval_count
            chunks = await in_thread(lambda: list(client.generate(model=model, prompt="hi", options=FAST, logprobs=True, top_logprobs=2, stream=True)))
            assert _shown(_ollama_entries([e for c in chunks for e in (c.logprobs or [])], 2)) == _shown(tokens)

            chat = await in_thread(client.chat, model=model, messages=MESSAGES, options=FAST, logprobs=True, top_logprobs=0)
            chat_tokens = _ollama_entries(chat.logprobs, 0)
            assert "".join(t for t, _ in chat_tokens) == chat.message.content
            streamed = await in_thread(lambda: list(client.chat(model=model, messages=MESSAGES, options=FAST, logprobs=True, top_logprobs=3, stream=True)))
            assert _shown(_ollama_entries([e for c in streamed for e in (c.logprobs or [])], 3)) == _shown(chat_tokens)
            plain = await in_thread(client.chat, model=model, messages=MESSAGES, options=FAST)
            assert plain.logprobs is None

            with pytest.raises(ollama.ResponseError) as caught:
                await in_thread(client.generate, model=model, prompt="hi", top_logprobs=21, logprobs=True)
            assert caught.value.status_code == 400 and "top_logprobs" in caught.value.error


@pytest.mark.parametrize("model", ["tiny", "base"])
async def test_openai_client_reads_chat_logprobs_streamed_and_whole(store: Path, model: str) -> None:
    with trio.fail_after(120):
        async with open_test_server(store) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
            ask = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "seed": 1, "logprobs": True, "top_logprobs": 2}
            whole = await in_thread(client.chat.completions.create, **ask)
            content = whole.choices[0].logprobs.content
            assert content and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
            assert "".join(e.token for e in content) == whole.choices[0].message.content
            stream = await in_thread(lambda: list(client.chat.completions.create(**ask, stream=True)))
            streamed = [e for c in stream for ch in c.choices if ch.logprobs and ch.logprobs.content for e in ch.logprobs.content]
            assert [(e.token, round(e.logprob, 3)) for e in streamed] == [(e.token, round(e.logprob, 3)) for e in content if e.token]

            # the same runner answers Ollama's chat with the same tokens and log-probabilities
            ours = await in_thread(ollama.Client(host=server.base_url).chat, model=model, messages=MESSAGES, options=FAST, logprobs=True, top_logprobs=2)
            assert [(e.token, round(e.logprob, 3)) for e in ours.logprobs] == [(e.token, round(e.logprob, 3)) for e in content]

            completion = await in_thread(client.completions.create, model=model, prompt="hi", max_tokens=4, temperature=0, logprobs=2)
            lp = completion.choices[0].logprobs  # OpenAI's fields, read by the client's own type
            assert len(lp.tokens) == completion.usage.completion_tokens and "".join(lp.tokens) == completion.choices[0].text
            assert all(len(top) <= 2 and top for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
            assert lp.text_offset[0] == len("hi")
            entries = lp.model_extra["content"]  # and llama-server's own list, unchanged
            assert [e["token"] for e in entries] == lp.tokens and [e["logprob"] for e in entries] == lp.token_logprobs
            chunks = await in_thread(lambda: list(client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0, logprobs=2, stream=True)))
            streamed_lp = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            assert [t for s in streamed_lp for t in s.tokens] == [t for t in lp.tokens if t]
            offsets = [o for s in streamed_lp for o in s.text_offset]
            assert offsets == sorted(offsets) and offsets[0] == len("hi")
