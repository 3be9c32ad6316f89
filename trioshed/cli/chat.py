"""``trioshed run``: a prompt answered once and streamed, or, on a terminal without a prompt, the
chat ``ollama run`` opens (``>>>`` prompts, ``/clear``, ``/?``, ``/bye``, ``\"\"\"`` for several
lines). Thinking is shown dimmed before the answer unless hidden; ``--verbose`` adds the timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from trioshed.cli.client import check_stream, checked, is_tty, open_client, stream_lines
from trioshed.cli.format import timings
from trioshed.cli.progress import Spinner
from trioshed.config import Settings

CHAT_HELP = """Available Commands:
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message.
"""


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


class Answer:
    """Writes a streamed answer: thinking (unless hidden) dimmed on a terminal, then the content;
    the spinner until the first token; the last chunk kept for ``--verbose``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.hide_thinking = bool(args.hidethinking)
        self.tty = is_tty(sys.stdout)
        self.spinner = Spinner(enabled=is_tty(sys.stderr))
        self.thinking = False
        self.last: dict[str, Any] = {}

    def write(self, thinking: str, content: str) -> None:
        if thinking or content:
            self.spinner.stop()
        if thinking and not self.hide_thinking:
            if not self.thinking:
                print("\x1b[2mThinking...\n" if self.tty else "Thinking...\n", end="", flush=True)
                self.thinking = True
            print(thinking, end="", flush=True)
        if content:
            if self.thinking:
                print("\n...done thinking.\n\x1b[0m\n" if self.tty else "\n...done thinking.\n\n", end="")
                self.thinking = False
            print(content, end="", flush=True)

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
    answer = Answer(args)
    answer.spinner.start()
    try:
        with open_client(settings) as client, client.stream("POST", "/api/generate", json=body) as response:
            check_stream(response)
            for chunk in stream_lines(response):
                answer.write(str(chunk.get("thinking") or ""), str(chunk.get("response") or ""))
                answer.last = chunk
    finally:
        answer.spinner.stop()
    answer.finish(args.verbose)
    return 0


def chat(args: argparse.Namespace, settings: Settings, read: Callable[[str], str] | None = None) -> int:
    """``ollama run MODEL`` on a terminal: ``>>>`` prompts (each line from ``read``, by default
    :func:`input` with line editing), ``/bye`` or end of input to leave."""
    if read is None:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        read = input
    messages: list[dict[str, Any]] = []
    with open_client(settings) as client:
        # load the model first (a request without messages), as ollama does, with the spinner
        spinner = Spinner(enabled=is_tty(sys.stderr))
        spinner.start()
        try:
            checked(client.post("/api/chat", json={"model": args.model, "messages": [], **keep_alive(args.keepalive)}))
        finally:
            spinner.stop()
        while True:
            try:
                line = read(">>> ")
            except EOFError:
                print()
                return 0
            if line.startswith('"""'):
                parts = [line[3:]]
                while not parts[-1].rstrip().endswith('"""'):
                    try:
                        parts.append(read("... "))
                    except EOFError:
                        print()
                        return 0
                line = "\n".join(parts).rstrip()[:-3]
            text = line.strip()
            if not text:
                continue
            if text in ("/bye", "/exit"):
                return 0
            if text == "/clear":
                messages.clear()
                print("Cleared session context")
                continue
            if text in ("/?", "/help"):
                print(CHAT_HELP, end="")
                continue
            if text.startswith("/"):
                print(f"Unknown command '{text.split()[0]}'. Type /? for help")
                continue
            messages.append({"role": "user", "content": line})
            body = {**generation_body(args), "messages": messages}
            answer = Answer(args)
            reply = []
            with client.stream("POST", "/api/chat", json=body) as response:
                check_stream(response)
                for chunk in stream_lines(response):
                    message = chunk.get("message") or {}
                    content = str(message.get("content") or "")
                    answer.write(str(message.get("thinking") or ""), content)
                    reply.append(content)
                    answer.last = chunk
            answer.finish(args.verbose)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})
