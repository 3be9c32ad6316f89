"""``trioshed run`` with a base model (no chat template): said once on standard error, a
paragraph of continuation at most :data:`CONTINUATION_TOKENS` long; a chat model is not named so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from tests.cli.test_cli import PROCESSES_GUARD, cli
from trioshed.cli.base_model import (
    CONTINUATION_TOKENS,
    Paragraph,
    is_base_model,
    notice,
    with_length,
)
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model


def test_a_paragraph_ends_at_the_first_blank_line_after_some_text() -> None:
    p = Paragraph()
    assert [p.feed(x) for x in ["\n\n", "Paris", ", Lyon.\n", "\n", "More."]] == ["\n\n", "Paris", ", Lyon.", "", ""]
    assert p.done and p.rest() == ""
    p = Paragraph()
    assert p.feed("one line\n") == "one line" and p.feed("two") == "\ntwo" and not p.done
    assert p.rest() == ""
    p = Paragraph()
    assert p.feed("ends with a newline\n") == "ends with a newline" and p.rest() == "\n"


def test_a_base_model_is_one_that_generates_without_a_template() -> None:
    assert is_base_model({"template": "", "capabilities": ["completion"]})
    assert not is_base_model({"template": "{{ .Prompt }}", "capabilities": ["completion"]})
    assert not is_base_model({"template": "", "capabilities": ["embedding"]})
    body = {"model": "m", "prompt": "x"}
    assert with_length(body, {"parameters": ""})["options"] == {"num_predict": CONTINUATION_TOKENS}
    assert with_length(body, {"parameters": "num_predict                    32"}) == body  # the model's own length
    assert with_length({**body, "options": {"num_predict": 5}}, {}) == {**body, "options": {"num_predict": 5}}
    assert "trioshed pull" in notice("m") and "continues" in notice("m")


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_run_says_a_base_model_continues_text_and_stops_at_a_paragraph(tmp_path: Path) -> None:
    store = tmp_path / "models"
    write_tiny_model(store / "base.gguf", chat_template="")
    write_tiny_model(store / "chat.gguf")
    (store / "models.toml").write_text('[models.plain]\npath = "base.gguf"\noptions = { temperature = 0, seed = 1 }\n')
    with trio.fail_after(PROCESSES_GUARD):
        async with open_test_server(store) as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            whole = await cli("run", "plain", "Once upon a time", "--verbose", env=env)
            cut = await cli("run", "plain", "Once upon a time", env=env)
            chat = await cli("run", "chat", "hi", env=env)
    assert whole.returncode == cut.returncode == chat.returncode == 0, (whole, cut, chat)
    said = notice("plain")
    assert whole.stderr.decode().splitlines()[0] == said
    stats = dict(line.split(":", 1) for line in whole.stderr.decode().splitlines()[1:])
    assert 0 < int(stats["eval count"].split()[0]) <= CONTINUATION_TOKENS
    assert cut.stderr.decode().splitlines() == [said]  # once, and nothing else
    paragraph = Paragraph()
    text = whole.stdout.decode().removesuffix("\n")
    expected = paragraph.feed(text) + paragraph.rest()
    assert cut.stdout.decode() == expected + "\n" and cut.stdout.strip()
    assert json.dumps(said) not in chat.stderr.decode() and said not in chat.stderr.decode()
