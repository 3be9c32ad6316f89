"""``trioshed run``: a prompt answered once and streamed, or, on a terminal without a prompt, the
chat ``ollama run`` opens: ``>>>`` prompts, ``\"\"\"`` for several lines, the slash commands of
:mod:`~trioshed.cli.chat_session` (``/set``, ``/show``, ``/load``, ``/save``, ``/clear``, ``/?``,
``/bye``), images by path (:mod:`~trioshed.cli.chat_input`), and Ctrl-C, which stops the answer
being written and nothing else. Thinking is shown dimmed before the answer unless hidden;
``--verbose`` (or ``/set verbose``) adds the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import trioshed.cli.chat_session as cs
from trioshed.cli.base_model import base_model_of, one_shot_of_base_model, with_length
from trioshed.cli.chat_input import (
    ImageError,
    LineReader,
    attach_images,
    default_reader,
    image_paths,
)
from trioshed.cli.chat_session import CHAT_HELP, Session
from trioshed.cli.client import (
    CommandError,
    check_stream,
    checked,
    error_of,
    is_tty,
    open_client,
    stream_lines,
)
from trioshed.cli.format import timings
from trioshed.cli.progress import Spinner
from trioshed.config import Settings

__all__ = ["CHAT_HELP", "Answer", "chat", "cmd_run"]


def keep_alive(value: str | None) -> dict[str, Any]:
    """``--keepalive`` as the request's field: seconds where it is a number, else the text."""
    if value is None:
        return {}
    try:
        return {"keep_alive": int(value)}
    except ValueError:
        return {"keep_alive": value}


def generation_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields every answer of ``run`` shares: model, streaming, keep-alive, format, think."""
    body: dict[str, Any] = {"model": args.model, "stream": True, **keep_alive(args.keepalive)}
    if args.format:
        body["format"] = args.format
    if args.think is not None:
        body["think"] = args.think
    return body


class Wrap:
    """Word wrap for a streamed answer on a terminal, as Ollama's chat wraps: when a line is
    full, the word being written moves to the next line (the cursor steps back over it); a word
    longer than the line is broken where it is."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.column = 0
        self.word = ""

    def __call__(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if ch in "\r\n":
                self.column, self.word = 0, ""
                out.append(ch)
            elif self.column + 1 > self.width - 5:
                if ch == " ":
                    out.append("\n")
                    self.column, self.word = 0, ""
                elif len(self.word) > self.width - 10:
                    out.append("\n" + ch)
                    self.column, self.word = 1, ch
                else:
                    back = f"\x1b[{len(self.word)}D" if self.word else ""
                    out.append(f"{back}\x1b[K\n{self.word}{ch}")
                    self.word += ch
                    self.column = len(self.word)
            else:
                out.append(ch)
                self.column += 1
                self.word = "" if ch in " \t" else self.word + ch
        return "".join(out)


class Answer:
    """Writes a streamed answer: thinking (unless hidden) dimmed on a terminal, then the content;
    the spinner until the first token; the last chunk kept for ``--verbose``; word-wrapped on a
    terminal where asked."""

    def __init__(self, hide_thinking: bool, wordwrap: bool = False) -> None:
        self.hide_thinking = hide_thinking
        self.tty = is_tty(sys.stdout)
        self.spinner = Spinner(enabled=is_tty(sys.stderr))
        self.thinking = False
        self.last: dict[str, Any] = {}
        self.wrap = Wrap(shutil.get_terminal_size().columns) if wordwrap and self.tty else None

    def _out(self, text: str) -> None:
        text = cs.printable(text)  # the model's text cannot drive the terminal
        print(self.wrap(text) if self.wrap is not None else text, end="", flush=True)

    def write(self, thinking: str, content: str) -> None:
        if thinking or content:
            self.spinner.stop()
        if thinking and not self.hide_thinking:
            if not self.thinking:
                print("\x1b[2mThinking...\n" if self.tty else "Thinking...\n", end="", flush=True)
                self.thinking = True
            self._out(thinking)
        if content:
            if self.thinking:
                print("\n...done thinking.\n\x1b[0m\n" if self.tty else "\n...done thinking.\n\n", end="")
                self.thinking = False
                if self.wrap is not None:
                    self.wrap = Wrap(self.wrap.width)
            self._out(content)

    def finish(self, verbose: bool) -> None:
        self.spinner.stop()
        if self.thinking:
            print("\n...done thinking.\x1b[0m" if self.tty else "\n...done thinking.", end="")
            self.thinking = False
        print(flush=True)
        if verbose:
            print(timings(self.last), end="", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    """``ollama run``: a prompt (arguments, standard input before them) answered once, streamed;
    without one on a terminal, a chat."""
    prompts = list(args.prompt)
    if not is_tty(sys.stdin):
        prompts.insert(0, sys.stdin.read())
    if not prompts:
        return chat(args, settings)
    body = {**generation_body(args), "prompt": " ".join(prompts)}
    answer = Answer(bool(args.hidethinking))
    answer.spinner.start()
    try:
        with open_client(settings) as client:
            body, paragraph = one_shot_of_base_model(client, body, args.verbose)
            with client.stream("POST", "/api/generate", json=body) as response:
                check_stream(response)
                for chunk in stream_lines(response):
                    text = str(chunk.get("response") or "")
                    answer.write(str(chunk.get("thinking") or ""), paragraph.feed(text) if paragraph else text)
                    answer.last = chunk
                    if paragraph and paragraph.done:
                        break  # the continuation's first paragraph is written: the request is closed
                if paragraph:
                    answer.write("", paragraph.rest())
    finally:
        answer.spinner.stop()
    answer.finish(args.verbose)
    return 0



def chat(args: argparse.Namespace, settings: Settings, read: Callable[[str], str] | None = None) -> int:
    """``ollama run MODEL`` on a terminal: ``>>>`` prompts (each line from ``read``, by default
    :func:`input` with line editing and history), ``/bye`` or end of input to leave."""
    session = Session(
        model=args.model, keep_alive=keep_alive(args.keepalive), format=args.format or "", think=args.think,
        hide_thinking=bool(args.hidethinking), verbose=bool(args.verbose),
        wordwrap=is_tty(sys.stdout) and os.environ.get("TERM", "") != "dumb",
    )  # fmt: skip
    answer_ctrl_c()
    return Chat(session, settings, read if read is not None else default_reader()).run()


def answer_ctrl_c() -> None:
    """A chat on a terminal answers Ctrl-C, as Ollama's does, even when it was started with
    SIGINT ignored (a shell's background job, ``nohup``) or blocked (inherited from the thread
    that started it): Ctrl-C is how an answer is stopped. (Only Python's main thread may set it.)"""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Chat:
    """The chat's loop: a line read, a command done or a message answered, until ``/bye``.

    Cancellation: Ctrl-C while an answer streams closes that request's connection (the server
    then cancels it and frees the model's slot); the words written so far stay in the
    conversation, and the chat goes on with a fresh connection. Ctrl-C at the prompt only says
    how to leave.
    """

    def __init__(self, session: Session, settings: Settings, read: Callable[[str], str]) -> None:
        self.session = session
        self.settings = settings
        self.read = read
        self.client = open_client(settings)
        self.base: dict[str, Any] | None = None  # /api/show's answer for a base model

    def run(self) -> int:
        try:
            self.load()
            self.show()
            print(cs.transcript(self.session.loaded), end="")
            return self.loop()
        finally:
            self.client.close()

    def load(self) -> None:
        """Load the model first (a request without messages), as ``ollama run`` does, with the spinner."""
        spinner = Spinner(enabled=is_tty(sys.stderr))
        spinner.start()
        try:
            checked(self.client.post("/api/chat", json={"model": self.session.model, "messages": [], **self.session.keep_alive}))
        finally:
            spinner.stop()

    def show(self) -> bool:
        """Read the model's capabilities and own messages; False where ``/api/show`` refused."""
        response = self.client.post("/api/show", json={"model": self.session.model})
        if response.status_code >= 400:
            self.session.capabilities = None
            return False
        self.session.apply_show(response.json())
        self.base = base_model_of(self.session.model, response.json())
        return True

    def gather(self, first: str) -> str:
        """A ``\"\"\"`` block from its first line to the line ending in ``\"\"\"`` (EOFError on the way out)."""
        parts = [first]
        while not parts[-1].rstrip().endswith('"""'):
            parts.append(self.read("... "))
        return "\n".join(parts).rstrip()[:-3]

    def loop(self) -> int:
        while True:
            try:
                line = self.read(">>> ")
                if line.startswith('"""'):
                    line = self.gather(line[3:])
                elif (words := line.split(maxsplit=2))[:2] == ["/set", "system"] and words[2:] and words[2].startswith('"""'):
                    line = "/set system " + self.gather(words[2][3:])
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                typed = getattr(self.read, "typed", lambda: "")()
                print("\nUse Ctrl + d or /bye to exit." if not typed else "")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not self.is_image(text):
                try:
                    if self.command(text) == "bye":
                        return 0
                except KeyboardInterrupt:  # a /show, /save or /load waiting on the server: given up
                    print()
                    self.reconnect()
                continue
            self.turn(line)

    def is_image(self, text: str) -> bool:
        """A line starting with a path to an image (not a command), as Ollama tells them apart."""
        first = text.split()[0]
        return any(path.startswith(first) for path in image_paths(text))

    def command(self, text: str) -> str:
        """A slash command done; ``"bye"`` to leave."""
        words = text.split()
        name = words[0]
        session = self.session
        if name in ("/bye", "/exit"):
            return "bye"
        if name == "/clear":
            session.clear()
            print("Cleared session context")
        elif name in ("/?", "/help"):
            topic = words[1].lstrip("/") if len(words) > 1 else ""
            helps = {"set": cs.SET_HELP, "unset": cs.UNSET_HELP, "show": cs.SHOW_HELP, "shortcut": cs.SHORTCUTS_HELP,
                     "shortcuts": cs.SHORTCUTS_HELP}  # fmt: skip
            print(helps.get(topic, CHAT_HELP + (cs.IMAGES_HELP if session.vision else "") + ("\n" if topic in helps else "")), end="")
        elif name == "/set":
            rest = text.split(maxsplit=2)[2] if len(words) > 2 else ""
            print(cs.command_set(session, words, rest.strip()), end="")
            if isinstance(self.read, LineReader):
                self.read.saving = session.history
        elif name == "/unset":
            print(cs.command_unset(session, words), end="")
        elif name == "/show":
            print(cs.command_show(session, words, self.client), end="")
        elif name == "/save":
            print(cs.command_save(session, words, self.client), end="")
        elif name == "/load":
            self.switch(words)
        else:
            print(f"Unknown command '{name}'. Type /? for help")
        return ""

    def switch(self, words: list[str]) -> None:
        """``/load MODEL``: another model, and none of the old conversation."""
        if len(words) != 2:
            print("Usage:\n  /load <modelname>")
            return
        session, name = self.session, words[1]
        print(f"Loading model '{name}'")
        response = self.client.post("/api/show", json={"model": name})
        if response.status_code >= 400:
            error = error_of(response)
            print(f"Couldn't find model '{name}'" if response.status_code == 404 or "not found" in error else f"error: {error}")
            return
        old = session.model
        session.model = name
        try:
            self.load()
        except CommandError as exc:
            session.model = old
            print(f"error: {exc}")
            return
        session.messages, session.system = [], ""
        session.apply_show(response.json())
        self.base = base_model_of(name, response.json())
        print(cs.transcript(session.loaded), end="")

    def turn(self, line: str) -> None:
        """One message answered, streamed as it is written; Ctrl-C stops only the answer."""
        session = self.session
        try:
            content, images, paths = attach_images(line)
        except ImageError as exc:
            print(f"Couldn't process file: {json.dumps(str(exc))}")
            return
        if images and session.capabilities is not None and not session.vision:
            print(f"error: {json.dumps(session.model)} does not support vision")
            return
        for path in paths:
            print(f"Added image '{path}'", file=sys.stderr)
        message: dict[str, Any] = {"role": "user", "content": content if images else line}
        if images:
            message["images"] = images
        session.messages.append(message)
        answer = Answer(session.hide_thinking, session.wordwrap)
        reply: list[str] = []
        stopped = False
        answer.spinner.start()
        try:
            body = session.body() if self.base is None else with_length(session.body(), self.base)
            with self.client.stream("POST", "/api/chat", json=body) as response:
                check_stream(response)
                for chunk in stream_lines(response):
                    said = chunk.get("message") or {}
                    answer.write(str(said.get("thinking") or ""), str(said.get("content") or ""))
                    reply.append(str(said.get("content") or ""))
                    answer.last = chunk
        except KeyboardInterrupt:
            stopped = True
            self.reconnect()
        except CommandError as exc:  # refused, or failed on the way: the question is not kept
            answer.spinner.stop()
            session.messages.pop()
            print(f"{chr(10) if reply else ''}error: {exc}")
            return
        finally:
            answer.spinner.stop()
        answer.finish(False)
        print()
        if "".join(reply):
            session.messages.append({"role": "assistant", "content": "".join(reply)})
        elif stopped:
            session.messages.pop()  # nothing was answered: the question goes too, as if not asked
        if session.verbose and not stopped:
            print(timings(answer.last), end="", file=sys.stderr, flush=True)

    def reconnect(self) -> None:
        """A new connection for the next request: the old one, cut mid-answer, is closed."""
        self.client.close()
        self.client = open_client(self.settings)
