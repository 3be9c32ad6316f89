"""The command line: Ollama's verbs and flags, one-line errors, client commands against a running
trioshed (real processes), what they print (pure), and serve's start-up errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio

from tests.support.paths import REPO
from trioshed import __version__
from trioshed.cli import COMMANDS, build_parser, main, run_command
from trioshed.cli import format as cli_format
from trioshed.cli.chat import CHAT_HELP, chat
from trioshed.cli.client import CommandError
from trioshed.cli.queries import cmd_list, cmd_show
from trioshed.config import Settings
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server

slow = pytest.mark.slow

#: A guard for tests that start a dozen CLI processes, each importing Python's HTTP stack: seconds
#: each on a loaded 2-core machine.
PROCESSES_GUARD = 300
pytestmark = [pytest.mark.usefixtures("no_leaked_runner")]


async def cli(*args: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "trioshed", *args], stdin=stdin,
        capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


def one_error_line(result: subprocess.CompletedProcess[bytes]) -> str:
    """The single ``Error: ...`` line a failed command prints (and nothing else, no traceback)."""
    [line] = result.stderr.decode().strip().splitlines()
    assert line.startswith("Error: ") and result.returncode != 0, result
    return line


@slow
async def test_client_commands(model_store: Path) -> None:
    with trio.fail_after(PROCESSES_GUARD):
        async with open_test_server(model_store) as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            listed = await cli("list", env=env)
            assert listed.returncode == 0 and b"tiny:latest" in listed.stdout
            ran = await cli("run", "tiny", "hello", env=env)
            assert ran.returncode == 0 and ran.stdout.strip() and not ran.stderr
            ps = await cli("ps", env=env)
            assert b"tiny:latest" in ps.stdout
            stopped = await cli("stop", "tiny", env=env)
            assert stopped.returncode == 0 and not stopped.stdout and server.scheduler.statistics().runners == ()
            missing = await cli("run", "nope", "hi", env=env)
            assert missing.returncode == 1 and "model 'nope' not found" in one_error_line(missing)


@slow
async def test_the_usage_command(model_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "ann"\nkey = "ann-secret-1"\ntokens_per_day = 1000000\n')
    with trio.fail_after(PROCESSES_GUARD):
        async with open_test_server(model_store, api_key="boss-secret-1", keys_file=keys, usage_db=tmp_path / "u.db") as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://"), "TRIOSHED_API_KEY": "ann-secret-1"}
            ran = await cli("run", "tiny", "hello", env=env)
            assert ran.returncode == 0
            table = (await cli("usage", env=env)).stdout.decode().splitlines()
            assert table[0].split("\t")[:4] == ["KEY", "MODEL", "START", "REQUESTS"]
            assert table[1].split("\t")[:2] == ["ann", "tiny:latest"] and table[1].split("\t")[3] == "1"
            prompt, completion = int(table[1].split("\t")[4]), int(table[1].split("\t")[6])
            assert table[3:] == ["KEY\tBUDGET\tLIMIT\tLEFT", f"ann\ttokens_per_day\t1000000\t{1000000 - prompt - completion}"]
            csv = (await cli("usage", "--csv", "--by", "hour", env=env)).stdout.decode().splitlines()
            assert csv[0] == "key,model,start,requests,prompt_tokens,cached_tokens,completion_tokens,errors,seconds,node"
            node = server.state.usage.node  # type: ignore[union-attr]  # the host name: TRIOSHED_NODE_NAME unset
            assert csv[1].endswith(f",{node}") and table[0].split("\t")[-1] == "NODE" and table[1].split("\t")[-1] == node
            assert (await cli("usage", "--node", "elsewhere", env=env)).stdout.decode().splitlines()[1:] == ["", *table[3:]]  # no row of that node; budgets as ever
            refused = await cli("usage", "--key", "default", env=env)
            assert "may read its own usage only" in one_error_line(refused)


@slow
async def test_serve_without_a_runner_binary_exits_1_with_advice(tmp_path: Path) -> None:
    with trio.fail_after(60):
        result = await cli("serve", "--models", str(tmp_path), env={"TRIOSHED_LLAMA_SERVER": "/nonexistent/llama-server"})
    assert result.returncode == 1 and "TRIOSHED_LLAMA_SERVER" in one_error_line(result)


@slow
async def test_bad_settings_exit_2_naming_the_variable() -> None:
    with trio.fail_after(60):
        result = await cli("ps", env={"TRIOSHED_MAX_QUEUE": "lots"})
    assert result.returncode == 2 and "TRIOSHED_MAX_QUEUE" in one_error_line(result)


@slow
async def test_serve_refuses_a_public_rpc_server(tmp_path: Path) -> None:
    with trio.fail_after(60):
        result = await cli("serve", "--models", str(tmp_path), env={"TRIOSHED_RPC_SERVERS": "127.0.0.1:50052,8.8.8.8:50052"})
    assert result.returncode == 2, result.stderr
    assert b"8.8.8.8:50052 is at a public address" in result.stderr and b"TRIOSHED_RPC_ALLOW_PUBLIC" in result.stderr


# --- the verbs, their help, the version, usage errors (in-process: no server needed) ---------

OLLAMA_VERBS = {"serve", "create", "show", "run", "stop", "pull", "push", "list", "ls", "ps", "cp", "rm", "help"}


def test_the_verbs_are_ollamas() -> None:
    verbs = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert verbs == OLLAMA_VERBS | {"start", "usage", "keys"}  # usage, keys: trioshed's own (keys and budgets)
    assert set(COMMANDS) == verbs - {"help"}


@pytest.mark.parametrize("verb", sorted(OLLAMA_VERBS))
def test_every_command_has_help(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    out = capsys.readouterr().out
    name = {"ls": "list"}.get(verb, verb)  # an alias shows its command's help
    assert exit_.value.code == 0 and out.startswith(f"usage: trioshed {name} ")
    description = out.split("\n\n")[1]
    assert description[0].isupper(), out  # a sentence saying what it does
    if verb not in ("help",):
        assert "TRIOSHED_HOST" in out  # where it listens or whom it asks
    with pytest.raises(SystemExit):
        main(["help", verb])  # `trioshed help VERB` is `trioshed VERB --help`
    assert capsys.readouterr().out == out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help"]) == 0
    out = capsys.readouterr().out
    for verb in OLLAMA_VERBS - {"ls"}:
        assert f"\n    {verb} " in out, verb
    assert "\n    list (ls) " in out and "\n    serve (start)" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out == out


@pytest.mark.parametrize(
    ("flags", "verb"),
    [
        (["--license", "--modelfile", "--parameters", "--system", "--template", "--verbose"], "show"),
        (["--format", "--keepalive", "--verbose", "--think", "--hidethinking"], "run"),
        (["--insecure"], "pull"),
        (["--insecure"], "push"),
        (["--file"], "create"),
    ],
)
def test_ollamas_flags_are_there(flags: list[str], verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = capsys.readouterr().out
    for flag in flags:
        assert f"  {flag}" in out or f", {flag}" in out, flag


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["run"], ["show"], ["cp", "only-one"], ["rm"], ["run", "m", "--format"], ["help", "bogus"], ["ps", "--what"]],
)
def test_usage_errors_are_one_line_with_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert exit_.value.code == 2 and line.startswith("Error: ") and "--help" in line and not captured.out


@slow
async def test_version_and_errors_from_a_real_process(tmp_path: Path) -> None:
    nobody = {"TRIOSHED_HOST": f"127.0.0.1:{free_port()}"}
    with trio.fail_after(PROCESSES_GUARD):
        version = await cli("--version", env=nobody)
        assert version.returncode == 0 and version.stdout.decode() == f"trioshed version is {__version__}\n"
        assert (await cli("-v", env=nobody)).stdout == version.stdout
        for argv in (["list"], ["ps"], ["show", "x"], ["stop", "x"], ["rm", "x"], ["cp", "a", "b"], ["run", "x", "hi"], ["push", "x"]):
            line = one_error_line(await cli(*argv, env=nobody))
            assert "could not connect to trioshed at 127.0.0.1:" in line and "trioshed serve" in line, argv
        bogus = await cli("frobnicate", env=nobody)
        assert bogus.returncode == 2 and "invalid choice: 'frobnicate'" in one_error_line(bogus)


# --- against a real server --------------------------------------------------------------------


def brief_store(model_store: Path) -> Path:
    """The tiny model also as ``brief``: 8 tokens per answer, a system message, no license."""
    tiny = model_store / "tiny.gguf"
    (model_store / "models.toml").write_text(
        f'[models.brief]\npath = {json.dumps(str(tiny))}\noptions = {{ num_predict = 8, temperature = 0 }}\nsystem = "Be brief."\n'
    )
    return model_store


@slow
async def test_list_show_cp_rm_as_ollama_prints_them(model_store: Path) -> None:
    with trio.fail_after(PROCESSES_GUARD):
        async with open_test_server(brief_store(model_store)) as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            listed = await cli("ls", env=env)
            header, *rows = listed.stdout.decode().splitlines()
            assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
            assert sorted(r.split()[0] for r in rows) == ["brief:latest", "tiny:latest"]

            shown = (await cli("show", "brief", env=env)).stdout.decode()
            for part in ("  Model\n", "    architecture        llama", "  Capabilities\n", "    completion",
                         "  Parameters\n", "    num_predict    8", "  System\n    Be brief."):  # fmt: skip
                assert part in shown, (part, shown)
            params = await cli("show", "brief", "--parameters", env=env)
            assert params.stdout.decode().split() == ["num_predict", "8", "temperature", "0"]
            assert (await cli("show", "brief", "--system", env=env)).stdout == b"Be brief.\n"
            assert (await cli("show", "brief", "--license", env=env)).stdout == b"No license was specified for this model.\n"
            modelfile = (await cli("show", "brief", "--modelfile", env=env)).stdout.decode()
            assert f"FROM {model_store / 'tiny.gguf'}" in modelfile
            verbose = (await cli("show", "brief", "--verbose", env=env)).stdout.decode()
            assert "  Metadata\n" in verbose and "llama.block_count" in verbose
            both = await cli("show", "brief", "--system", "--template", env=env)
            assert "only one of" in one_error_line(both)
            assert "model 'nope' not found" in one_error_line(await cli("show", "nope", env=env))

            copied = await cli("cp", "brief", "brief2", env=env)
            assert copied.returncode == 0 and copied.stdout == b"copied 'brief' to 'brief2'\n"
            assert b"brief2:latest" in (await cli("ls", env=env)).stdout
            removed = await cli("rm", "brief2", "nope", env=env)
            assert removed.stdout == b"deleted 'brief2'\n" and "nope" in one_error_line(removed)
            assert b"brief2" not in (await cli("ls", env=env)).stdout


@slow
async def test_run_stdin_verbose_ps_and_stop(model_store: Path) -> None:
    with trio.fail_after(PROCESSES_GUARD):
        async with open_test_server(brief_store(model_store)) as server:
            env = {"TRIOSHED_HOST": server.base_url.removeprefix("http://")}
            ran = await cli("run", "brief", "say", "hello", "--verbose", "--keepalive", "10m", env=env)
            assert ran.returncode == 0 and ran.stdout.strip(), ran
            stats = dict(line.split(":", 1) for line in ran.stderr.decode().splitlines())
            assert stats["eval count"].strip() == "8 token(s)" and "prompt eval rate" in stats
            piped = await cli("run", "brief", env=env, stdin=b"hello from a pipe")
            assert piped.returncode == 0 and piped.stdout.strip() and not piped.stderr
            # the same prompt, given the same way, gives the same answer at temperature 0
            again = await cli("run", "brief", "say", "hello", env=env)
            assert again.stdout == ran.stdout

            header, row = (await cli("ps", env=env)).stdout.decode().splitlines()
            assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
            assert row.split()[0] == "brief:latest" and "100% CPU" in row and row.endswith("minutes from now")

            stopped = await cli("stop", "brief", env=env)
            assert stopped.returncode == 0 and not stopped.stdout and not stopped.stderr
            assert server.scheduler.statistics().runners == ()
            again_stop = await cli("stop", "brief", env=env)
            assert one_error_line(again_stop) == 'Error: couldn\'t find model "brief" to stop'
            assert (await cli("ps", env=env)).stdout.decode().splitlines()[1:] == []


@slow
async def test_chat_on_a_terminal(model_store: Path) -> None:
    """``trioshed run MODEL`` on a terminal: a real process on a pseudo-terminal, two turns,
    ``/clear``, ``/?`` and ``/bye``."""
    import pty

    with trio.fail_after(120):
        async with open_test_server(brief_store(model_store)) as server:
            env = {**os.environ, "TRIOSHED_HOST": server.base_url.removeprefix("http://"), "TERM": "dumb"}
            main_fd, child_fd = pty.openpty()
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "trioshed", "run", "brief"], stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env
            )
            os.close(child_fd)
            seen = b""
            mark = 0  # each wait looks only at what came after the last one's match

            async def until(text: bytes) -> None:
                nonlocal seen, mark
                while (at := seen.replace(b"\r\n", b"\n").find(text, mark)) < 0:  # a terminal writes CRLF
                    try:
                        chunk = await trio.to_thread.run_sync(os.read, main_fd, 4096, abandon_on_cancel=True)
                    except OSError:  # EIO: the child closed the terminal
                        chunk = b""
                    assert chunk, seen
                    seen += chunk
                mark = at + len(text)

            try:
                await until(b">>> ")
                os.write(main_fd, b"hello\n")
                await until(b"\n\n>>> ")
                os.write(main_fd, b"/?\n")
                await until(b"/bye")
                os.write(main_fd, b"/clear\n")
                await until(b"Cleared session context")
                os.write(main_fd, b'"""two\nlines"""\n')
                await until(b"\n\n>>> ")
                os.write(main_fd, b"/bye\n")
                assert await process.wait() == 0
            finally:
                process.kill()
                await process.wait()
                os.close(main_fd)
            assert seen.count(b">>> ") >= 4 and b"Traceback" not in seen and b"Error" not in seen


# --- what the commands print (pure) -------------------------------------------------------------

NOW = datetime(2026, 12, 4, 10, 0, 0, tzinfo=UTC)


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def test_sizes_and_times_read_as_ollamas() -> None:
    assert [cli_format.human_bytes(n) for n in (0, 999, 1000, 9_400, 291_000_000, 4_700_000_000)] == [
        "0 B", "999 B", "1.0 KB", "9.4 KB", "291 MB", "4.7 GB"]  # fmt: skip
    assert cli_format.ago(iso(NOW - timedelta(days=2, hours=3)), NOW) == "2 days ago"
    assert cli_format.ago(iso(NOW - timedelta(minutes=1)), NOW) == "1 minute ago"
    assert cli_format.ago(iso(NOW), NOW) == "Less than a second ago"
    assert cli_format.until(iso(NOW + timedelta(minutes=4, seconds=30)), NOW) == "4 minutes from now"
    assert cli_format.until("2318-12-04T00:00:00Z", NOW) == "Forever"
    assert cli_format.until(iso(NOW - timedelta(seconds=1)), NOW) == "Stopping..."
    assert cli_format.ago("not a time", NOW) == ""
    assert [cli_format.processor(*p) for p in ((100, 0), (100, 100), (100, 52), (0, 0))] == [
        "100% CPU", "100% GPU", "48%/52% CPU/GPU", "100% CPU"]  # fmt: skip
    assert cli_format.parameter_count(268_098_176) == "268.10M"
    assert cli_format.parameter_count(8_030_261_248) == "8.03B"


def test_tables_pad_columns_by_three() -> None:
    answer = {"models": [
        {"name": "gemma3:270m", "digest": "sha256:e7d36fb2c3b3aa", "size": 291_000_000, "modified_at": iso(NOW - timedelta(days=2))},
        {"name": "a:b", "digest": "abc", "size": 5, "modified_at": iso(NOW - timedelta(hours=1))},
    ]}  # fmt: skip
    assert cli_format.list_table(answer, NOW) == (
        "NAME          ID             SIZE     MODIFIED\n"
        "gemma3:270m   e7d36fb2c3b3   291 MB   2 days ago\n"
        "a:b           abc            5 B      1 hour ago\n"
    )
    ps = {"models": [{"name": "m:latest", "digest": "d" * 64, "size": 500_000_000, "size_vram": 0,
                      "context_length": 4096, "expires_at": iso(NOW + timedelta(minutes=5))}]}  # fmt: skip
    assert cli_format.ps_table(ps, NOW) == (
        "NAME       ID             SIZE     PROCESSOR   CONTEXT   UNTIL\n"
        "m:latest   dddddddddddd   500 MB   100% CPU    4096      5 minutes from now\n"
    )
    assert cli_format.list_table({"models": []}, NOW) == "NAME   ID   SIZE   MODIFIED\n"


def test_show_text_has_ollamas_sections_and_cuts_long_texts() -> None:
    answer = {
        "model_info": {"general.architecture": "gemma3", "general.parameter_count": 268_098_176,
                       "gemma3.context_length": 32768, "gemma3.embedding_length": 640},
        "details": {"quantization_level": "Q4_K_M"},
        "capabilities": ["completion", "vision"],
        "parameters": 'stop                           "<end_of_turn>"\ntemperature                    1',
        "license": "line 1\nline 2\nline 3",
    }  # fmt: skip
    text = cli_format.show_text(answer)
    assert text == (
        "\n  Model\n"
        "    architecture        gemma3\n"
        "    parameters          268.10M\n"
        "    context length      32768\n"
        "    embedding length    640\n"
        "    quantization        Q4_K_M\n\n"
        "  Capabilities\n    completion\n    vision\n\n"
        '  Parameters\n    stop           "<end_of_turn>"\n    temperature    1\n\n'
        "  License\n    line 1\n    line 2\n    ...\n"
    )
    assert "    line 3\n" in cli_format.show_text(answer, verbose=True)


def test_timings_are_ollamas_verbose_lines() -> None:
    chunk = {"total_duration": 2_000_000_000, "load_duration": 500_000_000, "prompt_eval_count": 10,
             "prompt_eval_duration": 250_000_000, "eval_count": 8, "eval_duration": 1_000_000_000}  # fmt: skip
    lines = cli_format.timings(chunk).splitlines()
    assert lines[0] == "total duration:       2.000000s"
    assert "prompt eval rate:     40.00 tokens/s" in lines and "eval rate:            8.00 tokens/s" in lines
    assert cli_format.timings({}).splitlines()[-1] == "eval rate:            n/a"


def test_serves_help_gives_the_defaults_docs_settings_gives() -> None:
    import re

    from trioshed.cli import SERVE_EPILOG

    docs = (REPO / "docs" / "settings.md").read_text()
    named = re.findall(r"^  (TRIOSHED_\w+) .*\(default ([^)]+)\)", SERVE_EPILOG, flags=re.M)
    assert len(named) >= 6
    for name, text in named:
        default = text.split(": ")[0]  # "0: 3 per GPU, 3 on CPU" -> "0"
        row = re.search(rf"^\| `{name}` \| `([^`]+)`", docs, flags=re.M)
        assert row is not None and row[1] == default, (name, default)


# --- each verb alone: a function of its flags and the settings (in-process, a fake server) ------


class FakeOllama(BaseHTTPRequestHandler):
    """Answers ``/api/tags`` and ``/api/chat`` (streamed, echoing the last message), 404 for any
    other model to show; each request body is kept in ``seen``."""

    seen: list[tuple[str, dict[str, object]]] = []

    def _answer(self, status: int, lines: list[dict[str, object]]) -> None:
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        self.send_response(status)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append((self.path, {}))
        models = [{"name": "tiny:latest", "digest": "sha256:" + "e" * 64, "size": 9_400, "modified_at": "2026-12-04T10:00:00Z"}]
        self._answer(200, [{"models": models}])

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, request))
        if self.path != "/api/chat":
            self._answer(404, [{"error": f"model '{request['model']}' not found"}])
        elif not request["messages"]:
            self._answer(200, [{"done": True}])
        else:
            said = request["messages"][-1]["content"]
            self._answer(200, [{"message": {"content": "you said "}}, {"message": {"content": said}, "done": True}])

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[Settings]:
    """The settings of a client asking a :class:`FakeOllama` in a thread of this process."""
    FakeOllama.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOllama)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Settings(host="127.0.0.1", port=server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_verb_is_a_function_of_its_flags_and_settings(fake_server: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_list(build_parser().parse_args(["list"]), fake_server) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:4] == ["tiny:latest", "eeeeeeeeeeee", "9.4", "KB"]
    show = build_parser().parse_args(["show", "nope"])
    with pytest.raises(CommandError, match="model 'nope' not found"):
        cmd_show(show, fake_server)
    assert run_command(cmd_show, show, fake_server) == 1  # main's one error line, exit status 1
    assert capsys.readouterr().err == "Error: model 'nope' not found\n"
    nobody = Settings(host="127.0.0.1", port=free_port())
    assert run_command(cmd_list, build_parser().parse_args(["ls"]), nobody) == 1
    assert "could not connect to trioshed at 127.0.0.1:" in capsys.readouterr().err


def test_the_chat_reads_its_lines_from_the_caller(fake_server: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    lines = iter(["/?", "hello", '"""two', 'lines"""', "/clear", "/nope", "again"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert chat(build_parser().parse_args(["run", "m", "--keepalive", "10m"]), fake_server, read=read) == 0
    out = capsys.readouterr().out
    assert out.startswith(CHAT_HELP) and "you said hello\n\n" in out and "you said two\nlines\n\n" in out
    assert "Cleared session context\nUnknown command '/nope'. Type /? for help\nyou said again\n" in out
    chats = [body for path, body in FakeOllama.seen if path == "/api/chat"]
    assert chats[0] == {"model": "m", "messages": [], "keep_alive": "10m"}  # the model loaded first
    assert [m["content"] for m in chats[2]["messages"]] == ["hello", "you said hello", "two\nlines"]  # type: ignore[index]
    assert chats[3]["messages"] == [{"role": "user", "content": "again"}]  # after /clear
