"""The status page's playground with a base model (no chat template), in headless Chromium: it
says the model continues text and how to get a chat model, and shows the text with its
continuation (``/api/generate``, at most 128 tokens) instead of a chat."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.browser import open_browser
from tests.e2e.test_ui_browser import chromium  # noqa: F401 - the fixture
from tests.support.serve_process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]


async def test_the_playground_continues_a_base_models_text(chromium: str, tmp_path: Path) -> None:  # noqa: F811
    store = tmp_path / "models"
    store.mkdir()
    add_tiny(store, "base", chat_template="")
    add_tiny(store, "chat")
    with trio.fail_after(180):
        async with open_browser(chromium, tmp_path / "chromium.log") as browser:
            async with serve_process(store, TRIOSHED_CONTEXT_LENGTH="512") as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                await browser.navigate(f"{served.url}/ui")
                await browser.wait_for("[...document.querySelectorAll('#play-model option')].length === 2")
                await browser.evaluate("document.getElementById('play-model').value = 'chat:latest'; document.getElementById('play-model').dispatchEvent(new Event('change'))")
                assert await browser.evaluate("document.getElementById('play-kind').textContent") == "chat"
                await browser.evaluate("document.getElementById('play-model').value = 'base:latest'; document.getElementById('play-model').dispatchEvent(new Event('change'))")
                kind = await browser.evaluate("document.getElementById('play-kind').textContent")
                assert "base model" in kind and "continues your text" in kind and "trioshed pull" in kind
                assert await browser.evaluate("document.getElementById('play-label').textContent") == "Text to continue"
                assert await browser.evaluate("document.getElementById('play-chat').hidden") is True
                await browser.evaluate("document.getElementById('play-input').value = 'Once upon a time'; document.getElementById('play-form').requestSubmit()")
                await browser.wait_for("document.body.dataset.play === 'done'")
                shown = await browser.evaluate("document.getElementById('play-result').textContent")
                timings = await browser.evaluate("document.getElementById('play-timings').textContent")
                ps = (await http.get("/api/ps")).json()["models"]
    assert shown.startswith("Once upon a time") and len(shown) > len("Once upon a time")
    tokens = int(timings.rsplit("· ", 1)[1].split()[0])  # "first token … s · … tokens/s · N tokens"
    assert 0 < tokens <= 128, timings
    assert [m["name"] for m in ps] == ["base:latest"]
