"""Reading llama-server's HTTP/1.1 answers: a response parser without I/O (h11's shape, minimal).

llama-server (cpp-httplib) answers with a status line, headers, and a body framed by
``Content-Length`` or ``Transfer-Encoding: chunked`` (its streams); a body without either runs
until the connection closes. :class:`ResponseReader` is fed what the socket gave and returns the
body bytes it holds, de-chunked, so that one socket read becomes one batch of body bytes: under
load a read holds several events, and handling them together is the point of the hot path.

Only what a loopback client of llama-server needs: no pipelining, no 1xx, no trailers kept.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ProtocolError", "ResponseReader", "request_head"]

_MAX_HEAD = 64 * 1024


class ProtocolError(Exception):
    """The upstream sent something that is not an HTTP/1.1 answer we can read."""


def request_head(
    method: str, path: str, port: int, body_length: int, content_type: str = "application/json", api_key: str | None = None,
    *, host: str = "127.0.0.1", extra: Sequence[tuple[str, str]] = (),
) -> bytes:
    """The head of a request with a ``Content-Length`` body (keep-alive is HTTP/1.1's default);
    ``api_key`` is the runner's secret (see ``trioshed.runner.process``); ``extra``: more header
    lines (another node's request, relayed: ``trioshed.fleet.relay``)."""
    authority = f"[{host}]" if ":" in host else host  # an IPv6 address in brackets
    head = f"{method} {path} HTTP/1.1\r\nHost: {authority}:{port}\r\n"
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    for name, value in extra:
        head += f"{name}: {value}\r\n"
    if method != "GET" or body_length:
        head += f"Content-Type: {content_type}\r\nContent-Length: {body_length}\r\n"
    return (head + "\r\n").encode("ascii")


class ResponseReader:
    """One response, fed in pieces: ``feed(data)`` returns the body bytes the piece completed.

    After the head: ``status``, ``headers`` (lower-case names), ``keep_alive`` (whether the
    connection may carry another request once ``done``). ``received`` is how many bytes were
    fed: 0 means the upstream sent nothing at all (it never answered this request).
    """

    def __init__(self, *, head_only: bool = False) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.done = False
        self.received = 0
        self._head_only = head_only
        self._buffer = bytearray()
        self._length: int | None = None  # bytes of body left (Content-Length framing)
        self.chunked = False  # the body is chunked (llama-server's streams)
        self._chunk_left = 0  # bytes left of the current chunk's data
        self._until_close = False

    def feed(self, data: bytes) -> bytes:
        """The de-chunked body bytes ``data`` completes (``b""`` when none). Raises ProtocolError."""
        if self.done:
            if data:
                raise ProtocolError("llama-server sent bytes after the end of its answer")
            return b""
        self.received += len(data)
        if self.status is None:
            self._buffer += data
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD:
                    raise ProtocolError("llama-server's answer head is too long")
                return b""
            self._parse_head(bytes(self._buffer[:end]))
            data = bytes(self._buffer[end + 4 :])
            self._buffer.clear()
            if self.done:
                if data:
                    raise ProtocolError("llama-server sent a body where none belongs")
                return b""
        if self.chunked:
            return self._feed_chunked(data)
        if self._until_close:
            return data
        assert self._length is not None
        if len(data) > self._length:
            raise ProtocolError("llama-server sent more than its Content-Length")
        self._length -= len(data)
        self.done = self._length == 0
        return data

    def feed_eof(self) -> None:
        """The upstream closed the connection: fine for a body that runs until close, else an error."""
        if self.done:
            return
        if self.status is not None and self._until_close:
            self.done = True
            return
        if self.received == 0:
            raise ProtocolError("llama-server closed the connection without answering")
        raise ProtocolError("llama-server closed the connection in the middle of its answer")

    def _parse_head(self, head: bytes) -> None:
        try:
            text = head.decode("latin-1")
            status_line, *lines = text.split("\r\n")
            version, code, *_ = status_line.split(" ", 2)
            self.status = int(code)
        except (ValueError, UnicodeDecodeError):
            raise ProtocolError(f"llama-server sent a malformed status line: {head[:80]!r}") from None
        if not version.startswith("HTTP/1."):
            raise ProtocolError(f"llama-server answered with {version!r}, not HTTP/1.x")
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"llama-server sent a malformed header line: {line[:80]!r}")
            self.headers[name.strip().lower()] = value.strip()
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        if self._head_only or self.status in (204, 304) or 100 <= self.status < 200:
            self.done = True
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self.chunked = True
        elif "content-length" in self.headers:
            try:
                self._length = int(self.headers["content-length"])
            except ValueError:
                raise ProtocolError("llama-server sent a malformed Content-Length") from None
            self.done = self._length == 0
        else:
            self._until_close = True
            self.keep_alive = False

    def _feed_chunked(self, data: bytes) -> bytes:
        out: list[bytes] = []
        if self._chunk_left == 0 and not self._buffer:
            # The common case, whole chunks from a chunk boundary on (llama-server writes an event
            # per chunk, and a read ends where a write did): sliced straight out of ``data``.
            data = bytes(data)
            pos, n = 0, len(data)
            while pos < n:
                end = data.find(b"\r\n", pos, pos + 18)
                if end < 0:
                    break
                try:
                    size = int(data[pos:end], 16)
                except ValueError:
                    break  # an extension, or garbage: the general way below says which
                stop = end + 2 + size
                if size == 0 or stop + 2 > n or data[stop : stop + 2] != b"\r\n":
                    break  # the last chunk, an incomplete one or a bad one: the general way
                out.append(data[end + 2 : stop])
                pos = stop + 2
            data = data[pos:] if pos else data
        buf = self._buffer
        buf += data
        pos = 0
        while True:
            if self._chunk_left > 0:
                take = min(self._chunk_left, len(buf) - pos)
                if take <= 0:
                    break
                out.append(bytes(buf[pos : pos + take]))
                pos += take
                self._chunk_left -= take
                if self._chunk_left:
                    break
                self._chunk_left = -2  # the CRLF after the data
            if self._chunk_left == -2:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("llama-server sent a chunk without its closing CRLF")
                pos += 2
                self._chunk_left = 0
            if self._chunk_left == -1:  # trailer section after the last chunk
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:  # the blank line that ends the answer
                    pos += 2
                    self.done = True
                    if pos != len(buf):
                        raise ProtocolError("llama-server sent bytes after the end of its answer")
                    break
                pos = end + 2  # a trailer field: dropped
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > 1024:
                    raise ProtocolError("llama-server sent a malformed chunk size")
                break
            try:
                size = int(bytes(buf[pos:end]).split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolError(f"llama-server sent a malformed chunk size: {bytes(buf[pos:end])[:20]!r}") from None
            pos = end + 2
            self._chunk_left = size if size else -1
        del buf[:pos]
        return b"".join(out)
