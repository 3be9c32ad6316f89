"""The progress display of ``trioshed pull``: Ollama's pull lines in, terminal text out.

Pure (no I/O): :meth:`PullView.feed` takes one line of ``/api/pull``'s stream and returns the
text to write. On a terminal a layer's bar is redrawn in place (``\\r``) and each status ends its
own line, as ``ollama pull`` shows it::

    pulling manifest
    pulling 96c415656d37... 100% ▕████████████████████████████████████████▏ 4.7 GB
    verifying sha256 digest
    writing manifest
    success

Elsewhere (a log, a pipe) each status and each finished layer is one line, without redraws.
"""

from __future__ import annotations

from typing import Any

from trioshed.cli.format import human_bytes

BAR = 40


def bar(completed: int, total: int) -> str:
    filled = BAR if total <= 0 else min(BAR, completed * BAR // total)
    return "▕" + "█" * filled + " " * (BAR - filled) + "▏"


class PullView:
    def __init__(self, *, tty: bool) -> None:
        self.tty = tty
        self._open = ""  # the status of the line being redrawn ("" when at a line start)
        self._done: set[str] = set()

    def feed(self, line: dict[str, Any]) -> str:
        status = str(line.get("status", ""))
        if "digest" in line and isinstance(line.get("total"), int):
            total, completed = int(line["total"]), int(line.get("completed") or 0)
            percent = 100 if total <= 0 else completed * 100 // total
            size = human_bytes(total) if completed >= total else f"{human_bytes(completed)}/{human_bytes(total)}"
            text = f"{status}... {percent:3d}% {bar(completed, total)} {size}"
            if self.tty:
                prefix = "\n" if self._open and self._open != status else "\r" if self._open else ""
                self._open = status
                return f"{prefix}{text}\x1b[K"
            if completed >= total and status not in self._done:
                self._done.add(status)
                return text + "\n"
            return ""
        out = "\n" if self._open else ""
        self._open = ""
        return f"{out}{status}\n"

    def close(self) -> str:
        """What ends the display (a newline after a bar still open)."""
        out = "\n" if self._open else ""
        self._open = ""
        return out


class Spinner:
    """Ollama's spinner on a terminal while a model loads (nothing elsewhere): a thread redraws
    one frame every 100 ms until :meth:`stop`, which erases it. Idempotent, safe to stop twice."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, *, enabled: bool, stream: Any = None) -> None:
        import sys
        import threading

        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        import threading

        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._spin, name="spinner", daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        i = 0
        while not self._stopped.wait(0.1):
            try:
                self.stream.write(f"\r{self.FRAMES[i % len(self.FRAMES)]} ")
                self.stream.flush()
            except (OSError, ValueError):
                return
            i += 1

    def stop(self) -> None:
        if self._thread is None or self._stopped.is_set():
            self._stopped.set()
            return
        self._stopped.set()
        self._thread.join()
        try:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        except (OSError, ValueError):
            pass
