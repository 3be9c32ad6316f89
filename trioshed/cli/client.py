"""What every client command shares: the HTTP client for ``TRIOSHED_HOST``, the one-line error,
and reading the server's answers (its error message, its streamed JSON lines).

``httpx`` is imported only when a client is opened, so that ``--help``, ``--version`` without a
server and ``serve`` answer without Python's HTTP stack.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trioshed.config import Settings

if TYPE_CHECKING:
    import httpx


class CommandError(Exception):
    """A client command failed: the one line to print after ``Error: ``."""


def say(line: str) -> None:
    """A line on stderr for the operator: never fatal (a full disk, a closed terminal)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def open_client(settings: Settings, timeout: float | None = None) -> httpx.Client:
    """A client of the server ``settings`` name (a wildcard listen address asked on loopback),
    with the bearer key where one is set."""
    import httpx  # here, not at the top: ``--help`` and ``--version`` answer without it

    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    if host in ("0.0.0.0", "[::]"):
        host = "127.0.0.1"
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.Client(base_url=f"http://{host}:{settings.port}", timeout=timeout, headers=headers)


def error_of(response: httpx.Response) -> str:
    """The server's error message (Ollama's ``{"error": ...}``), else the status and body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str | dict):
        error = body["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    text = response.text.strip().splitlines()
    return f"the server answered {response.status_code}{': ' + text[0][:200] if text else ''}"


def checked(response: httpx.Response) -> httpx.Response:
    """``response``, unless the server refused: then :class:`CommandError` with its message."""
    if response.status_code >= 400:
        raise CommandError(error_of(response))
    return response


def check_stream(response: httpx.Response) -> None:
    """A streamed answer the server refused: its body read, then :class:`CommandError`."""
    if response.status_code >= 400:
        response.read()
        raise CommandError(error_of(response))


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def stream_lines(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON lines of a streamed answer; an ``error`` line raises."""
    for line in response.iter_lines():
        if not line.strip():
            continue
        chunk = json.loads(line)
        if "error" in chunk:
            raise CommandError(str(chunk["error"]))
        yield chunk
