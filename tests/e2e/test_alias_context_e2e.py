"""A model's ``num_ctx`` (here an alias's, from models.toml) holds while a larger runner of the same
file serves it: the prompt it may send is the size it was given, not whatever happens to be
loaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

TOML = """
[models.big]
path = "t.gguf"
options = { num_ctx = 4096 }

[models.small]
path = "t.gguf"
options = { num_ctx = 1024 }
"""


async def test_an_alias_num_ctx_holds_on_a_larger_runner_of_the_same_file(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "t.gguf", context_length=8192)
    (tmp_path / "models.toml").write_text(TOML)
    long_prompt = "ab " * 700  # 2,100 tokens (one a byte): over small's 1,024, under big's 4,096
    with trio.fail_after(120):
        async with open_test_server(tmp_path) as server, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            r = await http.post("/api/generate", json={"model": "big", "prompt": long_prompt, "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200, r.text
            r = await http.post("/api/generate", json={"model": "small", "prompt": long_prompt, "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 400 and "> 1024 maximum" in r.json()["error"], r.text
            r = await http.post("/v1/chat/completions", json={"model": "small", "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            async with http.stream("POST", "/api/chat", json={"model": "small", "messages": [{"role": "user", "content": long_prompt}]}) as streamed:
                assert streamed.status_code == 400  # streamed too: the status, not a 200 ending in an error
            r = await http.post("/api/generate", json={"model": "small", "prompt": "ab " * 100, "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200, r.text
            loaded = (await http.get("/api/ps")).json()["models"]
            assert len(loaded) == 1 and loaded[0]["context_length"] == 4096  # served by big's runner, never reloaded
