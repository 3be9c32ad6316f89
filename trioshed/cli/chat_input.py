"""What a person types into ``trioshed run``'s chat: lines read with the standard library's
``readline`` (editing, and history across sessions in ``~/.trioshed/history``, as Ollama keeps
``~/.ollama/history``), and image files named in a prompt, attached as Ollama's chat attaches them.

An image is named by its path: starting with ``/``, ``./``, ``~/`` or a drive letter, ending in
``.png``, ``.jpg``, ``.jpeg`` or ``.webp``, quoted (``'/my pics/cat.png'``) or with its spaces
escaped (``/my\\ pics/cat.png``), as a terminal writes a file dropped onto it. A path that names
no file stays text; one that names a file that is not such an image is refused.
"""

from __future__ import annotations

import base64
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

#: The most lines kept in the history file (Ollama keeps 100).
HISTORY_LINES = 100
#: The largest image attached (Ollama's limit).
MAX_IMAGE_BYTES = 100 * 1024 * 1024

_IMAGE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:~/|\./|/|\\)(?:\\ |[^\s]| )+?\.(?:png|jpe?g|webp)\b", re.IGNORECASE)
_ESCAPED = re.compile(r"\\([ ()\[\]{}$&;'\\*?~])")


def history_file() -> Path:
    """Where the chat's lines are kept between sessions: ``history`` in trioshed's home."""
    return Path.home() / ".trioshed" / "history"


class LineReader:
    """``input()`` with GNU readline's line editing and a history that outlives the session.

    History is saved only while :attr:`saving` (``/set history``, ``/set nohistory``); lines are
    remembered within the session either way, as Ollama's are, but a line typed while not saving
    never reaches the file, also once saving is back on. Without ``readline`` (or not on a
    terminal) it is plain ``input()``.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else history_file()
        self.saving = True
        self._typed = ""
        #: the session's history as readline holds it, each line with whether it may be saved
        self._lines: list[tuple[str, bool]] = []
        try:
            import readline
        except ImportError:
            self._readline = None
            return
        self._readline = readline
        readline.set_history_length(HISTORY_LINES)
        readline.set_auto_history(False)  # each line is added by __call__, blank ones not at all
        readline.clear_history()  # the file's lines, and only they
        try:
            readline.read_history_file(self.path)
        except OSError:  # none yet, or unreadable: start afresh
            pass
        items = (readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1))
        self._lines = [(line, True) for line in items if line is not None]

    def __call__(self, prompt: str) -> str:
        self._typed = ""
        if self._readline is None:
            return input(prompt)
        readline = self._readline

        def interrupted(signum: int, frame: object) -> None:
            # run before readline drops the line: what was typed decides what Ctrl-C says
            self._typed = readline.get_line_buffer()
            raise KeyboardInterrupt

        before = signal.signal(signal.SIGINT, interrupted)
        try:
            line = input(prompt)
        finally:
            signal.signal(signal.SIGINT, before)
        if not line.strip():
            return line
        readline.add_history(line)
        self._lines = [*self._lines, (line, self.saving)][-HISTORY_LINES:]
        if self.saving:
            self._save()
        return line

    def _save(self) -> None:
        """Write the history file: the session's lines less those typed while not saving (taken
        out of readline's history for the write, put back after)."""
        readline = self._readline
        assert readline is not None
        private = not all(saved for _, saved in self._lines)
        try:
            if private:
                readline.clear_history()
                for kept, saved in self._lines:
                    if saved:
                        readline.add_history(kept)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(self.path)
            self.path.chmod(0o600)
        except OSError:  # a read-only home: the chat goes on without saving
            pass
        finally:
            if private:
                readline.clear_history()
                for kept, _ in self._lines:
                    readline.add_history(kept)

    def typed(self) -> str:
        """The text on the line being edited when Ctrl-C interrupted it ("" where unknown)."""
        return self._typed


def default_reader() -> Callable[[str], str]:
    """Line editing and history on a terminal; plain ``input()`` elsewhere."""
    return LineReader() if sys.stdin.isatty() else input


def image_paths(text: str) -> list[str]:
    """The paths to image files ``text`` names, as typed (escapes and all). A path may hold
    spaces, so a candidate that names no file is tried again from its next start
    (``see ./a and /b.png``: ``/b.png``)."""
    found: list[str] = []
    pos = 0
    while (match := _IMAGE_PATH.search(text, pos)) is not None:
        if Path(unescape(match[0])).is_file():
            found.append(match[0])
            pos = match.end()
        else:
            pos = match.start() + 1
    return found


def unescape(path: str) -> str:
    """A path as a terminal escaped it (``my\\ pics``), unescaped, ``~`` expanded."""
    return str(Path(_ESCAPED.sub(r"\1", path)).expanduser())


class ImageError(Exception):
    """A named file that cannot be attached: the message says why."""


def image_kind(head: bytes) -> str | None:
    """The image type of a file from its first bytes: png, jpeg or webp; None for anything else."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def attach_images(text: str) -> tuple[str, list[str], list[str]]:
    """``text`` without the image paths it names, those images base64-encoded (the ``images``
    of a chat message), and their paths. A path that names no file stays in the text;
    :class:`ImageError` for a file that is not an image."""
    images: list[str] = []
    paths: list[str] = []
    for typed in image_paths(text):
        path = unescape(typed)
        try:
            with open(path, "rb") as f:
                kind = image_kind(f.read(16))
                if kind is None:
                    raise ImageError(f"invalid file type: {path} is not a png, jpeg or webp image")
                f.seek(0, 2)
                if f.tell() > MAX_IMAGE_BYTES:
                    raise ImageError("file size exceeds maximum limit (100MB)")
                f.seek(0)
                data = f.read()
        except FileNotFoundError:  # gone since it was seen
            continue
        except OSError as exc:
            raise ImageError(f"{path}: {exc.strerror or exc}") from None
        paths.append(path)
        for form in (f"'{path}'", f"'{typed}'", f'"{path}"', f'"{typed}"', typed):
            text = text.replace(form, "")
        images.append(base64.b64encode(data).decode())
    return text.strip(), images, paths
