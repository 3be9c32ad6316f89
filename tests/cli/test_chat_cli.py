"""``trioshed run``'s chat as a person uses it: each command typed on a real pseudo-terminal,
checking the screen and the requests that reach a server (a real trioshed with the tiny model
where tokens matter, a recording fake where only the request body matters); the commands' pure
parts (typing a parameter, finding image paths) alone."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import signal
import sys
import termios
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import trio

from trioshed.cli import build_parser
from trioshed.cli.chat import Answer, Chat, Wrap, chat
from trioshed.cli.chat_input import LineReader, attach_images, image_paths, unescape
from trioshed.cli.chat_session import Session, command_set, parameter, transcript
from trioshed.config import Settings
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import tiny_png, write_tiny_vision_projector

slow = pytest.mark.slow
#: The longest a terminal test waits for one thing to appear on the screen.
WAIT = 60
pytestmark = [pytest.mark.usefixtures("no_leaked_runner")]

#: The smallest PNG (1x1), and a file that only calls itself one.
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


# --- the pure parts -------------------------------------------------------------------------------


def test_parameters_are_typed_as_ollama_types_them() -> None:
    assert parameter("num_predict", ["12"]) == 12
    assert parameter("temperature", ["0.5"]) == 0.5
    assert parameter("use_mmap", ["false"]) is False
    assert parameter("stop", ["<|end|>", "User:"]) == ["<|end|>", "User:"]
    with pytest.raises(ValueError, match=r"^unknown parameter 'bogus'$"):
        parameter("bogus", ["1"])
    with pytest.raises(ValueError, match=r"^invalid int value \[many\]$"):
        parameter("num_predict", ["many"])
    with pytest.raises(ValueError, match=r"^invalid float value \[hot\]$"):
        parameter("temperature", ["hot"])


def test_set_answers_with_ollamas_words() -> None:
    session = Session(model="m")
    assert command_set(session, "/set parameter bogus 1".split(), "") == "Couldn't set parameter: \"unknown parameter 'bogus'\"\n"
    assert command_set(session, "/set parameter num_predict 12".split(), "") == "Set parameter 'num_predict' to '12'\n"
    assert command_set(session, "/set parameter stop a b".split(), "") == "Set parameter 'stop' to 'a, b'\n"
    assert command_set(session, "/set format yaml".split(), "") == "Invalid or missing format. For 'json' mode use '/set format json'\n"
    assert command_set(session, "/set think high".split(), "") == "Set 'think' mode to 'high'.\n"
    assert command_set(session, "/set bogus".split(), "") == "Unknown command '/set bogus'. Type /? for help\n"
    assert command_set(session, ["/set", "system", "Be", "brief."], "Be  brief.") == "Set system message.\n"
    assert session.body()["options"] == {"num_predict": 12, "stop": ["a", "b"]} and session.body()["think"] == "high"
    assert session.messages == [{"role": "system", "content": "Be  brief."}]
    command_set(session, ["/set", "system", "x"], "Be terse.")  # replaces a system message just set
    assert session.messages == [{"role": "system", "content": "Be terse."}]


def test_image_paths_are_found_as_a_terminal_writes_them(tmp_path: Path) -> None:
    folder = tmp_path / "my pics"
    folder.mkdir()
    (folder / "cat.png").write_bytes(PNG)
    (tmp_path / "fake.jpg").write_text("not an image")
    spaced = str(folder / "cat.png")
    escaped = spaced.replace(" ", "\\ ")
    assert image_paths(f"what is in {escaped}?") == [escaped]
    assert unescape(escaped) == spaced
    for typed in (f"what is in '{spaced}'", f"what is in {escaped}", f"what is in {spaced}"):
        text, images, paths = attach_images(typed)
        assert (text, images, paths) == ("what is in", [base64.b64encode(PNG).decode()], [spaced]), typed
    assert attach_images("see /nowhere/x.png please") == ("see /nowhere/x.png please", [], [])  # no file: text
    (tmp_path / "pic.JPEG").write_bytes(PNG)
    assert image_paths(f"a /path/to/notes.txt and {tmp_path}/pic.JPEG.") == [f"{tmp_path}/pic.JPEG"]
    assert image_paths("/nowhere/x.png") == []
    with pytest.raises(Exception, match="invalid file type"):
        attach_images(f"look {tmp_path / 'fake.jpg'}")


def test_word_wrap_moves_the_word_being_written() -> None:
    wrap = Wrap(20)  # lines of at most 15 columns
    out = wrap("the quick brown fox jumps")
    assert out.replace("\x1b[K", "").split("\n")[0].startswith("the quick brown")
    assert "\x1b[" in out or "\n" in out
    assert Wrap(20)("a\nb") == "a\nb"


def test_history_is_saved_only_while_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = iter(["first", "second"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    reader = LineReader(tmp_path / "h" / "history")
    reader(">>> ")
    assert "first" in (tmp_path / "h" / "history").read_text()
    reader.saving = False
    reader(">>> ")
    assert "second" not in (tmp_path / "h" / "history").read_text()
    assert oct((tmp_path / "h" / "history").stat().st_mode & 0o777) == "0o600"


def test_lines_typed_without_history_never_reach_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import readline

    lines = iter(["kept one", "private one", "kept two"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    reader = LineReader(tmp_path / "history")
    reader(">>> ")
    reader.saving = False  # /set nohistory
    reader(">>> ")
    reader.saving = True  # /set history
    reader(">>> ")
    saved = (tmp_path / "history").read_text()
    assert "kept one" in saved and "kept two" in saved and "private one" not in saved
    session = [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
    assert session == ["kept one", "private one", "kept two"]  # the session remembers it all (up-arrow)
    again = LineReader(tmp_path / "history")  # the next session: what was saved
    assert [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)] == ["kept one", "kept two"]
    assert again.saving


def test_a_models_text_cannot_drive_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    answer = Answer(hide_thinking=False)
    answer.write("thinking\x1b[8m hidden", "red\x1b[31m alert\x1b]0;owned\x07 \x9b2J back\x08\x7f done\r\nok\rover")
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\x08\x7f\r")
    assert "red^[[31m alert^[]0;owned^G \\x9b2J back^H^? done\nok^Mover" in out and "thinking^[[8m hidden" in out
    assert transcript([{"role": "assistant", "content": "saved\x1b[2Janswer"}]) == "saved^[[2Janswer\n\n"


# --- a recording fake server ------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """Ollama's API as far as the chat asks it: ``/api/show`` (the capabilities and messages the
    test sets), ``/api/chat`` (streamed, echoing the last message), ``/api/create``; each request
    body kept in ``seen``."""

    seen: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    capabilities: ClassVar[list[str]] = ["completion"]
    models: ClassVar[dict[str, dict[str, Any]]] = {}

    def _answer(self, status: int, lines: list[dict[str, Any]]) -> None:
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        self.send_response(status)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, request))
        name = request.get("model", "")
        if self.path == "/api/show":
            if name not in self.models:
                self._answer(404, [{"error": f"model '{name}' not found"}])
                return
            self._answer(200, [{"capabilities": self.capabilities, "modelfile": f"FROM {name}\n", **self.models[name]}])
        elif self.path == "/api/create":
            self.models[name] = {"messages": request.get("messages", [])}
            self._answer(200, [{"status": "success"}])
        elif name not in self.models:
            self._answer(404, [{"error": f"model '{name}' not found"}])
        elif not request["messages"]:
            self._answer(200, [{"done": True}])
        else:
            last = request["messages"][-1]
            said = f"you said {last['content']} with {len(last.get('images') or [])} image(s)"
            self._answer(200, [{"message": {"role": "assistant", "content": said}, "done": True, "eval_count": 3}])

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[Settings]:
    Recorder.seen, Recorder.capabilities, Recorder.models = [], ["completion"], {"m": {}, "eyes": {}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Settings(host="127.0.0.1", port=server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def chats(path: str = "/api/chat") -> list[dict[str, Any]]:
    return [body for p, body in Recorder.seen if p == path and body.get("messages", True) != []]


def lines_of(*typed: str) -> Any:
    lines = iter(typed)

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    return read


def test_settings_become_the_next_requests(recorder: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    read = lines_of("/set parameter num_predict 12", "/set parameter temperature 0", "/set system Be brief.", "/set format json",
                    "/set nothink", "hi", "/unset parameter temperature", "/unset format", "/unset system", "/set think", "again",
                    '/set system """Two', 'lines."""', "/clear", "third")  # fmt: skip
    assert chat(build_parser().parse_args(["run", "m"]), recorder, read=read) == 0
    out = capsys.readouterr().out
    assert "Set parameter 'num_predict' to '12'\n" in out and "Set system message.\n" in out and "Set format to 'json' mode.\n" in out
    first, second, third = chats()
    assert first["options"] == {"num_predict": 12, "temperature": 0.0} and first["format"] == "json" and first["think"] is False
    assert first["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert second["options"] == {"num_predict": 12} and "format" not in second and second["think"] is True
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]  # the system message unset
    assert third["messages"] == [{"role": "system", "content": "Two\nlines."}, {"role": "user", "content": "third"}]  # /clear keeps it


def test_show_save_and_load(recorder: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    read = lines_of("/show modelfile", "/show bogus", "/show", "hello", "/set parameter seed 7", "/save mine", "/load nope",
                    "/load mine", "go on", "/show parameters")  # fmt: skip
    assert chat(build_parser().parse_args(["run", "m"]), recorder, read=read) == 0
    out = capsys.readouterr().out
    assert "FROM m\n" in out and "Unknown command '/show bogus'. Type /? for help\n" in out and "/show modelfile    Show Modelfile" in out
    [create] = chats("/api/create")
    assert create == {"model": "mine", "from": "m", "stream": False, "parameters": {"seed": 7},
                      "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "you said hello with 0 image(s)"}]}  # fmt: skip
    assert "Created new model 'mine'\n" in out and "Couldn't find model 'nope'\n" in out
    # the saved conversation shown on load; the server (not the client) sends it before the new turn
    assert "Loading model 'mine'\n>>> hello\nyou said hello with 0 image(s)\n\n" in out
    assert chats()[-1]["model"] == "mine" and chats()[-1]["messages"] == [{"role": "user", "content": "go on"}]
    assert "User defined parameters:\n  seed                           7\n" in out


def test_an_image_reaches_a_vision_model_only(recorder: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "a cat.png"
    picture.write_bytes(PNG)
    typed = f"what is this? {str(picture).replace(' ', chr(92) + ' ')}"
    assert chat(build_parser().parse_args(["run", "m"]), recorder, read=lines_of(typed, "/?")) == 0
    captured = capsys.readouterr()
    assert 'error: "m" does not support vision\n' in captured.out and chats() == []
    assert "images" not in captured.out
    Recorder.capabilities = ["completion", "vision"]
    assert chat(build_parser().parse_args(["run", "eyes"]), recorder, read=lines_of(typed, "/?")) == 0
    captured = capsys.readouterr()
    [sent] = chats()
    assert sent["messages"] == [{"role": "user", "content": "what is this?", "images": [base64.b64encode(PNG).decode()]}]
    assert f"Added image '{picture}'" in captured.err and "you said what is this? with 1 image(s)" in captured.out
    assert "Use /path/to/file to include .jpg, .png, or .webp images." in captured.out


def test_a_failed_turn_leaves_the_chat_going(recorder: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    session = Session(model="gone")
    chat_ = Chat(session, recorder, lines_of("hello"))
    try:
        chat_.turn("hello")
    finally:
        chat_.client.close()
    assert capsys.readouterr().out.startswith("error: ") and session.messages == []


# --- on a real pseudo-terminal -------------------------------------------------------------------


class Terminal:
    """A ``trioshed run`` process on a pseudo-terminal that is its controlling terminal, so that
    Ctrl-C typed there is a SIGINT, as on a person's terminal."""

    def __init__(self, main_fd: int, process: trio.Process) -> None:
        self.fd = main_fd
        self.process = process
        self.seen = b""
        self.mark = 0

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    async def interrupt(self) -> None:
        """Ctrl-C at the prompt, once the chat waits for a key there.

        CPython's readline looks for a signal only when its ``select()`` on the terminal is
        interrupted: a SIGINT that lands after the prompt (or a key's echo) is written and before
        that ``select()`` begins waits, unnoticed, for the next key. A person cannot type in that
        gap; a test that answers the prompt at once can (seen under load). So wait until the chat's
        main thread sleeps in that wait (its system call in ``/proc``) before typing."""
        with trio.fail_after(WAIT):
            while not _waits_for_a_key(self.process.pid):  # noqa: ASYNC110 - another process, read in /proc
                await trio.sleep(0.01)
        self.type("\x03")

    async def enter(self, line: str) -> str:
        """Type ``line`` and Enter; what the chat wrote after it, up to the next prompt."""
        self.type(line + "\n")
        await self.until(line + "\n")
        return await self.until(">>> ")

    async def _read(self) -> None:
        try:
            chunk = await trio.to_thread.run_sync(os.read, self.fd, 4096, abandon_on_cancel=True)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        assert chunk, self.seen.decode(errors="replace")
        self.seen += chunk

    async def more(self, size: int) -> None:
        """Wait for ``size`` more bytes than have been read."""
        goal = len(self.seen) + size
        while len(self.seen) < goal:
            await self._read()

    async def until(self, text: str) -> str:
        """Wait for ``text`` after the last match; what came between (CRLF as LF)."""
        want = text.encode()
        try:
            with trio.fail_after(WAIT):
                while (at := self.seen.replace(b"\r\n", b"\n").find(want, self.mark)) < 0:
                    await self._read()
        except trio.TooSlowError:
            raise AssertionError(f"no {text!r} after: {self.seen[-2000:].decode(errors='replace')!r}") from None
        between = self.seen.replace(b"\r\n", b"\n")[self.mark : at].decode(errors="replace")
        self.mark = at + len(want)
        return between


#: The system calls (x86-64 and arm64 numbers) a process blocked on its terminal sleeps in:
#: select, pselect6, poll, ppoll, read.
_WAITS = {"x86_64": {23, 270, 7, 271, 0}, "aarch64": {72, 73, 63}}


def _waits_for_a_key(pid: int) -> bool:
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return bool(call) and call[0].isdigit() and int(call[0]) in _WAITS.get(os.uname().machine, set())


def _controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@asynccontextmanager
async def terminal(model: str, host: str, home: Path, *, sigint: str = "default") -> AsyncIterator[Terminal]:
    """``sigint``: what the chat inherits for SIGINT: ``default``, ``ignored`` (as a job started
    in the background by a shell, or under ``nohup``) or ``blocked`` (from a thread that had it
    blocked)."""
    env = {**os.environ, "TRIOSHED_HOST": host, "TERM": "dumb", "HOME": str(home)}
    main_fd, child_fd = os.openpty()

    def prepare() -> None:
        _controlling_terminal()
        if sigint == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif sigint == "blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trioshed", "run", model], stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env,
        start_new_session=True, preexec_fn=prepare,
    )  # fmt: skip
    os.close(child_fd)
    try:
        yield Terminal(main_fd, process)
    finally:
        process.kill()
        await process.wait()
        os.close(main_fd)


def recorder_host(settings: Settings) -> str:
    return f"{settings.host}:{settings.port}"


@slow
async def test_images_on_a_terminal(recorder: Settings, tmp_path: Path) -> None:
    """A dropped file's path (escaped spaces) reaches a vision model as an image, and is refused
    for a text model; ``/bye`` leaves."""
    picture = tmp_path / "my cat.png"
    picture.write_bytes(PNG)
    typed = f"describe {str(picture).replace(' ', chr(92) + ' ')}\n"
    with trio.fail_after(120):
        async with terminal("m", recorder_host(recorder), tmp_path) as term:
            await term.until(">>> ")
            term.type(typed)
            assert 'error: "m" does not support vision' in await term.until(">>> ")
            term.type("/bye\n")
            assert await term.process.wait() == 0
        assert chats() == []
        Recorder.capabilities = ["completion", "vision"]
        async with terminal("eyes", recorder_host(recorder), tmp_path) as term:
            await term.until(">>> ")
            term.type(typed)
            screen = await term.until(">>> ")
            assert f"Added image '{picture}'" in screen and "you said describe with 1 image(s)" in screen
            await term.enter("/set system Be brief.")
            await term.enter("/set parameter num_predict 12")
            await term.enter("and now?")
            term.type("\x04")  # Ctrl-D leaves
            assert await term.process.wait() == 0
    sent, then = chats()
    assert sent["messages"][0]["images"] == [base64.b64encode(PNG).decode()]
    assert then["messages"][-2:] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and now?"}]
    assert then["options"] == {"num_predict": 12}


@slow
async def test_an_image_path_reaches_a_real_vision_model(tmp_path: Path) -> None:
    """On a real server with the tiny vision pair (a model and its projector in one folder): a
    path typed in the prompt is attached, and the runner reads the image (the prompt is the
    image's tokens longer than the same words without it); the same model's copy without a
    projector refuses the path with the capability message."""
    store = tmp_path / "models"
    write_tiny_model(store / "tiny.gguf")
    write_tiny_model(store / "text.gguf")
    write_tiny_vision_projector(store / "mmproj-tiny-f16.gguf")
    picture = tmp_path / "cat.png"
    picture.write_bytes(tiny_png())
    with trio.fail_after(300):
        async with open_test_server(store) as server:
            host = server.base_url.removeprefix("http://")
            async with terminal("tiny", host, tmp_path) as term:
                await term.until(">>> ")
                await term.enter("/set verbose")
                await term.enter("/set parameter num_predict 2")
                plain = stat(await term.enter("what is it"), "prompt eval count")
                await term.enter("/clear")
                term.type(f"what is it {picture}\n")  # a long line: readline scrolls its echo
                await term.until(f"Added image '{picture}'")
                assert stat(await term.until(">>> "), "prompt eval count") > plain  # the image's tokens came with it
                await term.enter("/load text")
                term.type(f"what is it {picture}\n")
                assert 'error: "text" does not support vision' in await term.until(">>> ")
                term.type("/bye\n")
                assert await term.process.wait() == 0


def brief_store(model_store: Path) -> Path:
    """The tiny model also as ``brief`` (temperature 0)."""
    tiny = model_store / "tiny.gguf"
    (model_store / "models.toml").write_text(f"[models.brief]\npath = {json.dumps(str(tiny))}\noptions = {{ temperature = 0 }}\n")
    return model_store


def stat(screen: str, name: str) -> int:
    found = re.search(rf"^{name}:\s+(\d+) token\(s\)$", screen, flags=re.M)
    assert found, screen
    return int(found[1])


@slow
async def test_the_commands_against_a_real_server(model_store: Path, tmp_path: Path) -> None:
    """``/set parameter num_predict 12`` limits the next answer to 12 tokens; ``/set system``
    is the next request's system message; ``/show modelfile`` prints what ``/api/show``
    answers; ``/save`` then ``/load`` continues from the same messages; history is kept."""
    with trio.fail_after(300):
        async with open_test_server(brief_store(model_store)) as server:
            host = server.base_url.removeprefix("http://")
            async with terminal("brief", host, tmp_path) as term:
                await term.until(">>> ")
                await term.enter("/set verbose")
                await term.enter("/set parameter num_predict 12")
                screen = await term.enter("hello")
                assert stat(screen, "eval count") == 12
                assert "Couldn't set parameter: \"unknown parameter 'bogus'\"" in await term.enter("/set parameter bogus 1")

                await term.enter("/set system Answer in French.")
                assert "Answer in French." in await term.enter("/show system")
                with_system = stat(await term.enter("bonjour"), "prompt eval count")

                async with httpx.AsyncClient(base_url=server.base_url) as client:
                    modelfile = (await client.post("/api/show", json={"model": "brief"})).json()["modelfile"]
                assert modelfile.strip() in await term.enter("/show modelfile")

                assert "Created new model 'brief-chat'" in await term.enter("/save brief-chat")
                async with httpx.AsyncClient(base_url=server.base_url) as client:
                    saved = (await client.post("/api/show", json={"model": "brief-chat"})).json()
                assert [(m["role"], m["content"][:7]) for m in saved["messages"]][:3] == [
                    ("user", "hello"), ("assistant", saved["messages"][1]["content"][:7]), ("system", "Answer ")]
                assert saved["system"] == "Answer in French." and "num_predict" in saved["parameters"]

                term.type("/load brief-chat\n")
                await term.until("Loading model 'brief-chat'\n")
                await term.until(">>> hello\n")  # the saved conversation, shown
                await term.until("\n>>> bonjour\n")
                await term.until(">>> ")  # the prompt after the replay: typed before it, the line is echoed twice
                continued = stat(await term.enter("encore"), "prompt eval count")
                await term.enter("/load brief")
                await term.enter("/set system Answer in French.")
                fresh = stat(await term.enter("encore"), "prompt eval count")
                assert continued > fresh and continued > with_system  # the saved turns came before "encore"
                (tmp_path / "cat.png").write_bytes(PNG)
                term.type(f"what is {tmp_path / 'cat.png'}\n")  # a long line: readline scrolls its echo
                assert 'error: "brief" does not support vision' in await term.until(">>> ")
                term.type("/bye\n")
                assert await term.process.wait() == 0
            assert "hello" in (tmp_path / ".trioshed" / "history").read_text()


@slow
@pytest.mark.parametrize("sigint", ["default", "ignored", "blocked"])
async def test_ctrl_c_stops_only_the_answer(model_store: Path, tmp_path: Path, sigint: str) -> None:
    """Ctrl-C while an answer is written returns to ``>>>`` at once, the request is cancelled
    (the runner's slot is free long before the answer would have ended), and the chat goes on;
    Ctrl-C at the prompt says how to leave, Ctrl-D leaves. So too when the chat was started with
    SIGINT ignored or blocked (a shell's background job, a parent's thread): a chat on a terminal
    always answers Ctrl-C, as Ollama's does."""
    # wider and longer than the default tiny model: 16,000 tokens take minutes to write here
    write_tiny_model(model_store / "long.gguf", context_length=16384, n_embd=256, n_layer=4)
    with trio.fail_after(300):
        async with open_test_server(model_store) as server:
            host = server.base_url.removeprefix("http://")
            async with terminal("long", host, tmp_path, sigint=sigint) as term:
                await term.until(">>> ")
                await term.interrupt()
                assert "Use Ctrl + d or /bye to exit." in await term.until(">>> ")
                term.type("half a line")
                await term.until("half a line")
                await term.interrupt()  # Ctrl-C on a line being typed drops it, and says nothing
                assert "Use Ctrl + d" not in await term.until(">>> ")
                await term.enter("/set parameter num_ctx 16384")
                await term.enter("/set parameter num_predict 16000")
                await term.enter("/set verbose")
                term.type("tell me everything\n")
                await term.until("tell me everything\n")
                await term.more(300)  # the answer is being written
                term.type("\x03")
                assert "total duration" not in await term.until("\n>>> ")  # stopped, not finished

                def busy() -> int:
                    return sum(r.leases for r in server.scheduler.statistics().runners)

                with trio.fail_after(10):
                    while busy():  # noqa: ASYNC110 - the scheduler's statistics are a snapshot, polled
                        await trio.sleep(0.05)
                await term.enter("/set parameter num_predict 4")
                with trio.fail_after(30):
                    assert stat(await term.enter("and now?"), "eval count") == 4
                term.type("\x04")  # Ctrl-D leaves
                assert await term.process.wait() == 0


def test_an_answer_stopped_stays_in_the_conversation(recorder: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C mid-answer (a KeyboardInterrupt while the stream is read): the words written so
    far stay as the answer, the cut connection is replaced, and the chat goes on."""

    def stream() -> Iterator[bytes]:
        yield json.dumps({"message": {"role": "assistant", "content": "Once upon"}}).encode() + b"\n"
        raise KeyboardInterrupt

    def stopped(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(b"") if request.url.path != "/api/chat" else _Iter(stream()))

    session = Session(model="m")
    chat_ = Chat(session, recorder, lines_of())
    cut = chat_.client
    chat_.client = httpx.Client(transport=httpx.MockTransport(stopped), base_url="http://test")
    try:
        chat_.turn("tell me a story")
        assert capsys.readouterr().out.startswith("Once upon\n\n")
        assert session.messages == [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "Once upon"}]
        assert chat_.client is not cut and chat_.client.base_url == cut.base_url  # a fresh connection to the same server
        chat_.turn("and then?")
        assert [m["content"] for m in chats()[-1]["messages"]] == ["tell me a story", "Once upon", "and then?"]
    finally:
        cut.close()
        chat_.client.close()


class _Iter(httpx.SyncByteStream):
    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
