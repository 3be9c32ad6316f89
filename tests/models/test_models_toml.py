"""models.toml: every per-model key, the problems reported for bad ones, the store using it."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from trioshed.api.state import AppState
from trioshed.config import Settings
from trioshed.core.model import Placement
from trioshed.errors import BadRequest, ModelNotFound
from trioshed.models.catalogue import ALLOWED_ARGS, load_catalogue, parse_catalogue
from trioshed.models.store import ModelStore
from trioshed.runner.command import build_command

FULL = """
[models."qwen-long"]
path = "base.gguf"
aliases = ["qwen", "assistant:v2"]
adapters = ["lora.gguf"]
options = { temperature = 0.2 }
num_ctx = 8192
num_parallel = 2
keep_alive = "1h"
pinned = true
preload = true
priority = 10
args = ["--rope-scaling", "yarn", "--yarn-orig-ctx", 32768, "--no-context-shift", "--reasoning-budget=-1"]
"""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    for name in ("base", "lora", "plain"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    return tmp_path


def test_every_key_is_read(store: Path) -> None:
    cat = parse_catalogue(FULL, "models.toml", store)
    assert cat.problems == ()
    (entry,) = cat.entries
    assert entry.name == "qwen-long:latest" and entry.path == str(store / "base.gguf")
    assert entry.aliases == ("qwen:latest", "assistant:v2") and entry.adapters == (str(store / "lora.gguf"),)
    assert dict(entry.options) == {"temperature": 0.2, "num_ctx": 8192}
    assert (entry.num_parallel, entry.keep_alive, entry.pinned, entry.preload, entry.priority) == (2, 3600.0, True, True, 10)
    assert entry.args == ("--rope-scaling", "yarn", "--yarn-orig-ctx", "32768", "--no-context-shift", "--reasoning-budget", "-1")
    assert cat.lookup("qwen:latest") is entry and cat.lookup("assistant:v2") is entry and cat.preload == (entry,)


def test_a_pinned_model_is_kept_forever_unless_it_says_otherwise(store: Path) -> None:
    cat = parse_catalogue('[models.a]\npath = "base.gguf"\npinned = true\n[models.b]\npath = "base.gguf"\npinned = true\nkeep_alive = "10m"\n[models.c]\npath = "base.gguf"\n', "f", store)  # fmt: skip
    assert [e.keep_alive for e in cat.entries] == [math.inf, 600.0, None]


@pytest.mark.parametrize(
    ("table", "key", "reason"),
    [
        ('path = "base.gguf"\npriority = "high"', "models.bad.priority", "must be an integer"),
        ('path = "base.gguf"\nnum_parallel = 0', "models.bad.num_parallel", "at least 1"),
        ('path = "base.gguf"\nnum_ctx = true', "models.bad.num_ctx", "must be an integer"),
        ('path = "base.gguf"\nkeep_alive = "soon"', "models.bad.keep_alive", "invalid duration"),
        ('path = "base.gguf"\npinned = "yes"', "models.bad.pinned", "true or false"),
        ('path = "base.gguf"\npreload = 1', "models.bad.preload", "true or false"),
        ('path = "base.gguf"\ntemperature = 0.2', "models.bad.temperature", "unknown key"),
        ('path = "base.gguf"\naliases = ["../x"]', "models.bad.aliases", "invalid model name"),
        ('path = "base.gguf"\naliases = "x"', "models.bad.aliases", "list of strings"),
        ('path = "base.gguf"\noptions = 3', "models.bad.options", "must be a table"),
        ('path = 7', "models.bad.path", "must be a file path"),
        ('adapters = ["lora.gguf"]', "models.bad.path", "is required"),
        ('path = "base.gguf"\nargs = ["--port", "1"]', "models.bad.args", "'--port' is not allowed"),
        ('path = "base.gguf"\nargs = ["-c", "1"]', "models.bad.args", "'-c' is not allowed"),
        ('path = "base.gguf"\nargs = ["--ubatch-size", "1"]', "models.bad.args", "is not allowed"),
        ('path = "base.gguf"\nargs = ["yarn"]', "models.bad.args", "unexpected value 'yarn'"),
        ('path = "base.gguf"\nargs = ["--rope-scaling"]', "models.bad.args", "needs a value"),
        ('path = "base.gguf"\nargs = ["--mlock=1"]', "models.bad.args", "takes no value"),
        ('path = "base.gguf"\nargs = "--mlock"', "models.bad.args", "must be a list"),
    ],
)  # fmt: skip
def test_an_invalid_entry_is_reported_with_file_key_and_reason_and_the_rest_loads(
    store: Path, table: str, key: str, reason: str
) -> None:
    text = f'[models.good]\npath = "base.gguf"\n\n[models.bad]\n{table}\n\n[models.also-good]\npath = "plain.gguf"\n'
    cat = parse_catalogue(text, "/srv/models.toml", store)
    assert [e.name for e in cat.entries] == ["good:latest", "also-good:latest"]
    (problem,) = cat.problems
    assert (problem.file, problem.key) == ("/srv/models.toml", key)
    assert reason in problem.reason and "'bad' is not served" in problem.reason
    assert str(problem).startswith(f"/srv/models.toml: {key}: ")


def test_names_clashes_and_structure(store: Path) -> None:
    text = (
        'stray = 1\n[models.a]\npath = "base.gguf"\naliases = ["b"]\n'
        '[models.b]\npath = "plain.gguf"\n'  # "b" is a's alias already
        '[models."c:latest"]\npath = "plain.gguf"\n[models."../x"]\npath = "plain.gguf"\n'
        '[models.gone]\npath = "missing.gguf"\n'
    )
    cat = parse_catalogue(text, "m.toml", store)
    assert [e.name for e in cat.entries] == ["a:latest", "c:latest", "gone:latest"]
    keys = [(p.key, p.reason.split(";")[0].split(" (")[0]) for p in cat.problems]
    assert keys[0] == ("stray", "unknown key: models go in [models.NAME] tables")
    assert keys[1] == ("models.b", "name 'b:latest' is already used by [models.a]")
    assert keys[2][0] == 'models."../x"' and "invalid model name" in keys[2][1]
    assert keys[3][0] == "models.gone.path" and "does not exist (yet)" in cat.problems[3].reason
    assert len(keys) == 4


def test_a_dotted_name_left_unquoted_gets_a_hint(store: Path) -> None:
    cat = parse_catalogue('[models.qwen2.5]\npath = "base.gguf"\n', "m.toml", store)
    assert cat.entries == ()
    assert [p.key for p in cat.problems] == ["models.qwen2.5", "models.qwen2.path"]
    assert 'must be quoted: [models."qwen2.5"]' in cat.problems[0].reason


def test_unparseable_toml_is_one_clear_problem(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text("[models.a\npath = ")
    cat = load_catalogue(tmp_path / "models.toml")
    assert cat.entries == () and len(cat.problems) == 1
    assert "not valid TOML" in cat.problems[0].reason and cat.problems[0].file == str(tmp_path / "models.toml")
    assert load_catalogue(tmp_path / "absent.toml").problems == ()


def test_store_logs_problems_serves_the_rest_and_plain_files_even_when_the_toml_is_broken(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (store / "models.toml").write_text(FULL + '\n[models.bad]\npath = "base.gguf"\npriority = "high"\n')
    caplog.set_level(logging.WARNING, logger="trioshed.models.store")
    s = ModelStore(store)
    s.catalogue()
    assert [r.getMessage() for r in caplog.records] == [
        f"{store / 'models.toml'}: models.bad.priority: must be an integer, got 'high' (model 'bad' is not served)"
    ]
    s.catalogue()
    assert len(caplog.records) == 1  # unchanged file: parsed (and logged) once
    s.reload()
    s.catalogue()
    assert len(caplog.records) == 2  # reload() parses again (SIGHUP), once
    names = [spec.name for spec in s.list()]
    assert names == ["assistant:v2", "base:latest", "lora:latest", "plain:latest", "qwen-long:latest", "qwen:latest"]
    via_alias = s.resolve("qwen")
    assert via_alias.name == "qwen:latest" and via_alias.path == str(store / "base.gguf")
    assert (via_alias.num_parallel, via_alias.keep_alive, via_alias.pinned, via_alias.priority) == (2, 3600.0, True, 10)
    assert via_alias.args[:2] == ("--rope-scaling", "yarn")
    with pytest.raises(ModelNotFound):
        s.resolve("bad")

    (store / "models.toml").write_text("[models.a\n")  # broken: reparsed because it changed
    assert [spec.name for spec in s.list()] == ["base:latest", "lora:latest", "plain:latest"]
    assert s.resolve("plain").path == str(store / "plain.gguf")
    assert "not valid TOML" in caplog.records[-1].getMessage()


def test_an_entry_whose_file_is_missing_is_a_400_and_not_listed(store: Path) -> None:
    (store / "models.toml").write_text('[models.later]\npath = "later.gguf"\n')
    s = ModelStore(store)
    with pytest.raises(BadRequest, match="does not exist"):
        s.resolve("later")
    assert "later:latest" not in [spec.name for spec in s.list()]
    (store / "later.gguf").write_bytes(b"GGUF")  # appears later: served without a reload
    assert s.resolve("later").path == str(store / "later.gguf")


def test_runner_options_and_command_line_take_the_model_settings(store: Path) -> None:
    (store / "models.toml").write_text(FULL)
    s = ModelStore(store)
    state = AppState(settings=Settings(num_parallel=1, context_length=4096), store=s, scheduler=None)  # type: ignore[arg-type]
    spec = s.resolve("qwen-long")
    options = state.runner_options(spec, {})
    assert (options.num_parallel, options.num_ctx) == (2, 8192)
    assert state.runner_options(spec, {"num_ctx": 1024}).num_ctx == 1024  # the request wins
    plain = state.runner_options(s.resolve("plain"), {})
    assert (plain.num_parallel, plain.num_ctx, plain.extra_args) == (1, 4096, ())
    argv = build_command("/bin/llama-server", spec, options, Placement(0), port=1)
    assert argv[argv.index("--parallel") + 1] == "2" and argv[argv.index("--ctx-size") + 1] == str(2 * 8192)
    tail = argv[argv.index("--rope-scaling") :]
    assert tail[:6] == ["--rope-scaling", "yarn", "--yarn-orig-ctx", "32768", "--no-context-shift", "--reasoning-budget"]


def test_the_allow_list_leaves_out_what_trioshed_controls() -> None:
    controlled = {"--model", "--port", "--host", "--ctx-size", "--parallel", "--n-gpu-layers", "--device",
                  "--tensor-split", "--main-gpu", "--batch-size", "--ubatch-size", "--threads", "--flash-attn",
                  "--cache-type-k", "--cache-type-v", "--embeddings", "--pooling", "--lora", "--mmproj", "--alias",
                  "--fit", "--override-tensor", "--api-key", "--log-verbosity", "--no-mmap", "--swa-full",
                  "--spec-type", "--model-draft", "--spec-draft-ngl", "--device-draft"}  # fmt: skip
    assert not controlled & set(ALLOWED_ARGS)
    assert all(flag.startswith("--") for flag in ALLOWED_ARGS)


def test_every_allowed_flag_is_one_the_binary_knows() -> None:
    """A new llama.cpp pin that drops or renames an allow-listed flag fails here, not in a load."""
    import subprocess

    from trioshed.runner.binary import find_llama_server

    server = find_llama_server()
    help_text = subprocess.run([server.path, "--help"], env=server.env, capture_output=True, text=True, timeout=60).stdout
    known = {word.rstrip(",") for word in help_text.split() if word.startswith("-")}
    assert "--rope-scaling" in known  # the help text was read
    assert sorted(set(ALLOWED_ARGS) - known) == []
