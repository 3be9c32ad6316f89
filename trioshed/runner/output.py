"""What a runner's child printed last, kept as bytes.

A runner at llama-server's trace level (the level that prints the buffer sizes memory
accounting reads) writes tens of lines for each request, hundreds once its prompt cache holds
many prompts. While it serves, nothing reads them but a crash report, so they are kept as they
came: the last :data:`TAIL_BYTES` of output in one buffer, split into lines only when read. A
line each, they cost a decode and an object each (about a microsecond), and kept the allocator
busy with strings that lived for a few requests.
"""

from __future__ import annotations

#: Bytes of output kept: the last 200 or so lines of a runner's log.
TAIL_BYTES = 32 * 1024
#: Lines a report shows at most (:meth:`OutputTail.text`'s default is fewer).
TAIL_LINES = 200
_ERROR_WORDS = ("error", "failed", "exception", "what()")


class OutputTail:
    """The last output a child printed: for error messages and ``/api/ps``-style diagnostics."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._cut = False  # whether output before the buffer's start was dropped

    def feed(self, data: bytes | bytearray) -> None:
        """Keep ``data``, as it came (whole lines or not)."""
        self._buffer += data
        if len(self._buffer) > 2 * self.limit:  # trimmed now and then, not at every write
            del self._buffer[: len(self._buffer) - self.limit]
            self._cut = True

    def lines(self) -> list[str]:
        """The kept output's last :data:`TAIL_LINES` lines (a line cut at the start left out)."""
        start = max(0, len(self._buffer) - self.limit)
        lines = bytes(self._buffer[start:]).decode("utf-8", "replace").split("\n")
        if self._cut or start:
            lines = lines[1:]
        if lines and lines[-1] == "":
            lines.pop()
        return [line.rstrip("\r") for line in lines[-TAIL_LINES:]]

    def text(self, lines: int = 20) -> str:
        return "\n".join(self.lines()[-lines:]) if lines > 0 else ""

    def errors(self, lines: int = 6) -> str:
        """The lines most likely to explain a failure (errors first, else the last lines)."""
        kept = self.lines()
        interesting = [line for line in kept if any(w in line.lower() for w in _ERROR_WORDS)]
        return "\n".join((interesting or kept)[-lines:])
