"""Read a GGUF file's metadata and tensor table in milliseconds.

``gguf.GGUFReader`` decodes every array it meets, vocabularies included: 22.5 s to open
gemma3-270m (262k tokens). The scheduler needs only the architecture numbers, the tensor table
and a few strings, so this module parses the header itself with ``struct`` over a window of
plain reads: scalars, strings and small arrays (at most :data:`SMALL_ARRAY` elements, e.g.
per-layer head counts) are decoded; bigger arrays are stepped over (fixed-size ones by
arithmetic, string ones by their length prefixes, found with numpy for long vocabularies) and
recorded as :class:`ArrayInfo`. Type sizes come from the ``gguf`` package's constants.
gemma3-270m's header takes 35-55 ms on a busy 2-core machine (load 6; printed by
``tests/models/test_gguf_meta.py::test_gemma3_fields``).

Format (GGUF v2/v3, little-endian): ``"GGUF"``, u32 version, u64 tensor count, u64 key-value count,
the key-values (u64-length string key, u32 value type, value), the tensor infos (name, u32 n_dims,
u64 dims, u32 ggml type, u64 offset relative to the data section), padding to ``general.alignment``
(default 32), then the tensor data.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np

from trioshed.core.context import trained_context
from trioshed.errors import ModelUnreadable

__all__ = ["SMALL_ARRAY", "ArrayInfo", "GGUFError", "GGUFMetadata", "TensorInfo", "cached_metadata", "read_metadata", "unreadable"]

log = logging.getLogger(__name__)

#: Arrays with at most this many elements are decoded (as tuples); longer ones become ArrayInfo.
SMALL_ARRAY = 64
#: How many parsed headers :func:`read_metadata` keeps: every model the status page lists (500)
#: stays cached, so a listing after the first costs a stat per model.
CACHE_SIZE = 1024

_GGUF_MAGIC = b"GGUF"
_VT = gguf.GGUFValueType
_SCALAR_FORMATS: dict[int, str] = {
    _VT.UINT8: "<B",
    _VT.INT8: "<b",
    _VT.UINT16: "<H",
    _VT.INT16: "<h",
    _VT.UINT32: "<I",
    _VT.INT32: "<i",
    _VT.FLOAT32: "<f",
    _VT.BOOL: "<?",
    _VT.UINT64: "<Q",
    _VT.INT64: "<q",
    _VT.FLOAT64: "<d",
}
_SCALARS = {vt: struct.Struct(fmt) for vt, fmt in _SCALAR_FORMATS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version, truncated).

    Its message names the path and may quote the file's first bytes: for the log, never for a
    client (:func:`unreadable` says what a client may be told)."""

    def __init__(self, message: str, problem: str = "damaged or not a GGUF file") -> None:
        super().__init__(message)
        self.problem = problem  # what a client may be told: no path, no bytes


def unreadable(model: str, path: str, exc: Exception) -> ModelUnreadable:
    """The client's error for a model file that :func:`read_metadata` refused; the details
    (path, the bytes a non-GGUF file starts with) are logged here and go no further."""
    log.warning("model %s: cannot read %s: %s", model, path, exc)
    if isinstance(exc, GGUFError):
        problem = exc.problem
    elif isinstance(exc, OSError):
        problem = f"its file cannot be opened ({exc.strerror or type(exc).__name__})"
    else:
        problem = "damaged or not a GGUF file"
    return ModelUnreadable(model, problem)


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array too long to decode: its element type, length, and where its elements
    start in the file (``offset``: read them on demand, e.g. a vocabulary's tokens)."""

    type: gguf.GGUFValueType
    length: int
    offset: int = field(default=0, compare=False)

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    ``shape`` is in ggml order (``ne0`` first: the row length), as stored in the file.
    ``offset`` is the absolute byte offset of the tensor's data in the file.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        try:
            return gguf.GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass(frozen=True, eq=False)
class GGUFMetadata:
    """A GGUF file's key-values and tensor table, with the architecture numbers as properties.

    ``fields`` maps each key to a Python value: ``int``/``float``/``bool``/``str`` scalars, small
    arrays as tuples, long arrays as :class:`ArrayInfo`. Architecture keys (``{arch}.block_count``)
    are read through the properties, which apply llama.cpp's defaults.
    """

    path: str
    version: int
    fields: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]
    file_size: int
    data_offset: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """``fields["{architecture}.{suffix}"]``, e.g. ``arch_get("attention.head_count")``."""
        return self.fields.get(f"{self.architecture}.{suffix}", default)

    @functools.cached_property
    def tensor_map(self) -> Mapping[str, TensorInfo]:
        return MappingProxyType({t.name: t for t in self.tensors})

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    @property
    def name(self) -> str | None:
        value = self.fields.get("general.name")
        return None if value is None else str(value)

    @property
    def context_length(self) -> int:
        return int(self.arch_get("context_length", 0))

    @property
    def trained_context(self) -> int:
        """The context the model was trained for: ``context_length``, or longer where the GGUF
        declares RoPE scaling (``trioshed.core.context.trained_context``)."""
        try:
            factor = float(self.arch_get("rope.scaling.factor", 0.0) or 0.0)
            original = int(self.arch_get("rope.scaling.original_context_length", 0) or 0)
        except (TypeError, ValueError):
            factor, original = 0.0, 0
        return trained_context(
            self.context_length, scaling_type=str(self.arch_get("rope.scaling.type", "") or ""),
            factor=factor, original=original,
        )  # fmt: skip

    @property
    def block_count(self) -> int:
        return int(self.arch_get("block_count", 0))

    @property
    def embedding_length(self) -> int:
        return int(self.arch_get("embedding_length", 0))

    @property
    def head_count(self) -> int | tuple[int, ...]:
        return _int_or_tuple(self.arch_get("attention.head_count", 0))

    @property
    def head_count_kv(self) -> int | tuple[int, ...]:
        """KV heads: one number, or one per layer (some architectures vary it by layer)."""
        return _int_or_tuple(self.arch_get("attention.head_count_kv", self.head_count))

    def head_count_kv_per_layer(self) -> tuple[int, ...]:
        """``head_count_kv`` expanded to one entry per layer."""
        value = self.head_count_kv
        if isinstance(value, tuple):
            return value
        return (value,) * self.block_count

    @property
    def key_length(self) -> int:
        """Per-head key width; llama.cpp's default is ``n_embd / n_head``."""
        return int(self.arch_get("attention.key_length", self._default_head_dim()))

    @property
    def value_length(self) -> int:
        return int(self.arch_get("attention.value_length", self._default_head_dim()))

    def _default_head_dim(self) -> int:
        heads = self.head_count
        n_head = max(heads) if isinstance(heads, tuple) else heads
        return self.embedding_length // n_head if n_head else 0

    @property
    def sliding_window(self) -> int | None:
        value = self.arch_get("attention.sliding_window")
        return None if value is None else int(value)

    @property
    def sliding_window_pattern(self) -> int | tuple[bool, ...] | None:
        """``attention.sliding_window_pattern`` if the file has it: a period or one flag a layer."""
        value = self.arch_get("attention.sliding_window_pattern")
        if value is None or isinstance(value, ArrayInfo):
            return None
        return value if isinstance(value, tuple) else int(value)

    @property
    def file_type(self) -> int | None:
        value = self.fields.get("general.file_type")
        return None if value is None else int(value)

    @property
    def quantization(self) -> str:
        """``"Q4_K_M"``, ``"F16"``…: the name of ``general.file_type``, else the dominant tensor type."""
        ftype = self.file_type
        if ftype is not None:
            try:
                name = gguf.LlamaFileType(ftype).name
            except ValueError:
                name = ""
            for prefix in ("MOSTLY_", "ALL_"):
                if name.startswith(prefix):
                    return name[len(prefix) :]
        by_type: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        return max(by_type, key=by_type.__getitem__) if by_type else "unknown"

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def chat_template(self) -> str | None:
        value = self.fields.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int:
        value = self.arch_get("vocab_size")
        if value is not None:
            return int(value)
        tokens = self.fields.get("tokenizer.ggml.tokens")
        return len(tokens) if tokens is not None else 0


def _int_or_tuple(value: Any) -> int | tuple[int, ...]:
    if isinstance(value, tuple):
        return tuple(int(v) for v in value)
    if isinstance(value, ArrayInfo):  # more than SMALL_ARRAY layers: not decoded
        raise GGUFError(f"per-layer array of {value.length} entries was not decoded")
    return int(value)


def read_metadata(path: str | os.PathLike[str], *, size: int = 0, modified: float = 0.0) -> GGUFMetadata:
    """Parse ``path``'s GGUF header, through the one cache of headers (:data:`CACHE_SIZE`).

    ``size`` and ``modified`` (``st_mtime``) are the file's identity as a caller saw it (a
    :class:`~trioshed.core.model.ModelSpec` as the store resolved it): a hit then costs no system
    call. Otherwise the file is found by its real path, size and mtime as it is now (a stat).
    Raises :class:`GGUFError` for files that are not GGUF v2/v3 or are cut short, and ``OSError``
    (``FileNotFoundError``…) when the file cannot be opened.
    """
    if size and modified:
        meta = _headers.get((os.fspath(path), size, modified))
        if meta is not None:
            return meta
    key = _identity(path)
    meta = _headers.get(key)
    if meta is None:
        meta = parse_file(key[0], key[1])
        _remember(key, meta)
    if size and modified:  # the caller's name for the file may not be its real path
        _remember((os.fspath(path), size, modified), meta)
    return meta


#: The one cache of parsed headers, by the file's identity (path, size, mtime), oldest out first.
#: The lock guards the eviction only (readers run on the event loop and in worker threads).
_headers: dict[tuple[str, int, float], GGUFMetadata] = {}
_lock = threading.Lock()


def cached_metadata(
    path: str | os.PathLike[str], *, size: int = 0, modified: float = 0.0
) -> GGUFMetadata | None:
    """The header if the cache holds it for the file as it is now (a stat, no read), or as the
    caller saw it (``size`` and ``modified`` given: no system call): lets async callers skip the
    worker thread on the hot path."""
    if size and modified:
        meta = _headers.get((os.fspath(path), size, modified))
        if meta is not None:
            return meta
    try:
        return _headers.get(_identity(path))
    except OSError:
        return None


def _identity(path: str | os.PathLike[str]) -> tuple[str, int, float]:
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime


def _remember(key: tuple[str, int, float], meta: GGUFMetadata) -> None:
    with _lock:
        while len(_headers) >= CACHE_SIZE:
            del _headers[next(iter(_headers))]
        _headers[key] = meta


def parse_file(path: str, size: int | None = None) -> GGUFMetadata:
    """Parse without the cache (what :func:`read_metadata` calls on a miss)."""
    with open(path, "rb") as f:
        if size is None:
            size = os.fstat(f.fileno()).st_size
        head = f.read(min(size, _CHUNK))
        if head[:4] != _GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')", "not a GGUF file")
        return _Parser(path, f, head, size).parse()


#: String arrays at least this long are stepped over with numpy (see ``vector_skip_strings``).
_VECTOR_MIN = 2048
#: ``_chain_end``'s answer for "the window holds too few records": look further.
_MORE = -1
#: Bytes read at a time; most headers (all but long vocabularies) fit in the first read.
_CHUNK = 1024 * 1024


class _Parser:
    """A cursor over the file's header; every read checks bounds so truncation is a GGUFError.

    ``buf`` holds the bytes ``[base, base + len(buf))`` of the file; when the parse runs past
    them the window moves forward (the parse never goes back). ``struct.unpack_from`` on
    ``bytes`` is twice as fast as on an ``mmap``; long string arrays are read straight into a
    numpy array and scanned there.
    """

    def __init__(self, path: str, f: io.BufferedReader, head: bytes, size: int) -> None:
        self.path = path
        self.f = f
        self.buf = head
        self.base = 0
        self.size = size
        self.pos = 0

    def refill(self, n: int) -> None:
        """Move the window to start at ``pos`` and hold at least ``n`` bytes (or up to EOF)."""
        self.f.seek(self.pos)
        self.buf = self.f.read(min(self.size - self.pos, max(n, _CHUNK)))
        self.base = self.pos

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at byte {self.pos} of {self.size}", "damaged GGUF file (truncated or corrupt)")

    def need(self, n: int) -> int:
        """Check that ``n`` bytes follow ``pos``; return ``pos``'s offset in ``buf``."""
        end = self.pos + n
        if end > self.base + len(self.buf):
            if end > self.size:
                raise self.fail(f"truncated GGUF file: {n} more bytes needed")
            self.refill(n)
        return self.pos - self.base

    def u32(self) -> int:
        at = self.need(4)  # first: it may move the window
        (v,) = _U32.unpack_from(self.buf, at)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        at = self.need(8)
        (v,) = _U64.unpack_from(self.buf, at)
        self.pos += 8
        return int(v)

    def string(self) -> str:
        n = self.u64()
        at = self.need(n)
        raw = self.buf[at : at + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        st = _SCALARS.get(vtype)
        if st is not None:
            at = self.need(st.size)
            (v,) = st.unpack_from(self.buf, at)
            self.pos += st.size
            return v
        if vtype == _VT.STRING:
            return self.string()
        if vtype == _VT.ARRAY:
            etype = self.u32()
            n = self.u64()
            if n <= SMALL_ARRAY:
                return tuple(self.value(etype) for _ in range(n))
            start = self.pos
            self.skip_array(etype, n)
            try:
                return ArrayInfo(gguf.GGUFValueType(etype), n, start)
            except ValueError:
                raise self.fail(f"unknown array element type {etype}") from None
        raise self.fail(f"unknown value type {vtype}")

    def skip_array(self, etype: int, n: int) -> None:
        st = _SCALARS.get(etype)
        if st is not None:
            if self.pos + st.size * n > self.size:
                raise self.fail(f"truncated GGUF file: array of {n} elements")
            self.pos += st.size * n
        elif etype == _VT.STRING:
            self.skip_strings(n)
        else:
            for _ in range(n):
                self.value(etype)

    def skip_strings(self, n: int) -> None:
        """Step over ``n`` length-prefixed strings (262k of them in gemma3's vocabulary)."""
        if n >= _VECTOR_MIN:
            end = self.vector_skip_strings(n)
            if end is not None:
                self.pos = end
                return
        unpack = _U64.unpack_from
        done = 0
        while done < n:
            at = self.need(8)
            buf, base = self.buf, self.base
            i = done
            try:
                for i in range(done, n):  # noqa: B007 (i is read when a prefix is past the buffer)
                    at += 8 + unpack(buf, at)[0]
                done = n
            except struct.error:
                done = i  # the length prefix at ``at`` lies past the window: move it
            self.pos = base + at
            if self.pos > self.size:
                raise self.fail("truncated GGUF file inside a string array")

    def vector_skip_strings(self, n: int) -> int | None:
        """Find the end of ``n`` strings with numpy, or None to fall back to the exact loop.

        The Python loop costs ~130 ns a string. Instead, guess every record start at once: a
        length prefix of a string shorter than 64 KiB is two bytes and six zero bytes, followed by
        a non-zero first text byte (the byte just before a start also shows six zeros after it,
        but its eighth byte is zero). If the first ``n`` guesses chain exactly (each start plus 8
        plus its length is the next guess), they *are* the record starts, by induction from the
        known first one; any other outcome (a NUL in a token, a long string, a short file)
        returns None and the loop does the work.
        """
        start = self.pos
        window = n * 20
        for _attempt in range(3):
            count = min(self.size - start, window + 16)
            if count < 16:
                return None
            # Read into numpy directly (one copy). Not an mmap: a file truncated under a mapping
            # (``cp`` over a model while it is listed) would kill the server with SIGBUS.
            region = np.empty(count, np.uint8)
            self.f.seek(start)
            if self.f.readinto(region.data) != count:
                return None
            end = _chain_end(region, n)
            if end != _MORE:
                return start + end if end is not None and start + end <= self.size else None
            if start + window >= self.size:
                return None
            window *= 4
        return None

    def parse(self) -> GGUFMetadata:
        self.pos = 4
        version = self.u32()
        if version not in (2, 3):
            if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
                raise self.fail("big-endian GGUF file: only little-endian files are supported")
            raise self.fail(f"unsupported GGUF version {version} (this reader handles 2 and 3)")
        n_tensors = self.u64()
        n_kv = self.u64()
        # Each key-value takes at least 12 bytes and each tensor info at least 24: reject absurd
        # counts (a corrupt header) before looping over them.
        if n_kv * 12 + n_tensors * 24 > self.size:
            raise self.fail(
                f"truncated or corrupt GGUF header ({n_kv} key-values, {n_tensors} tensors)"
            )
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string()
            vtype = self.u32()
            fields[key] = self.value(vtype)
        raw_tensors = []
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.u32()
            if n_dims > 8:
                raise self.fail(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(self.u64() for _ in range(n_dims))
            ggml_type = self.u32()
            offset = self.u64()
            raw_tensors.append((name, ggml_type, shape, offset))
        alignment = int(fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)) or 1
        data_offset = -(-self.pos // alignment) * alignment
        tensors = []
        for name, ggml_type, shape, offset in raw_tensors:
            nbytes = _tensor_nbytes(ggml_type, shape)
            if nbytes is None:
                raise self.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
            start = data_offset + offset
            if start + nbytes > self.size:
                raise GGUFError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte "
                    f"{start + nbytes}, the file has {self.size}",
                    "truncated GGUF file",
                )
            tensors.append(TensorInfo(name, ggml_type, shape, nbytes, start))
        return GGUFMetadata(
            path=self.path,
            version=version,
            fields=MappingProxyType(fields),
            tensors=tuple(tensors),
            file_size=self.size,
            data_offset=data_offset,
        )


def _chain_end(a: np.ndarray[Any, np.dtype[np.uint8]], n: int) -> int | None:
    """Where ``n`` chained records starting at ``a[0]`` end, if the guesses chain (see above).

    Returns the end as an offset into ``a``, None when the guesses do not chain (fall back to
    the loop), or :data:`_MORE` when ``a`` holds fewer than ``n`` guesses (look further).
    """
    size = len(a) - 8
    zero = a == 0
    z2 = zero[:-1] & zero[1:]  # z2[i]: bytes i, i+1 are zero
    z4 = z2[:-2] & z2[2:]  # z4[i]: bytes i..i+3
    m = z4[2 : 2 + size] & z2[6 : 6 + size]  # m[p]: bytes p+2..p+7
    m &= a[8:] != 0
    starts = np.flatnonzero(m)[:n]
    if len(starts) == 0 or starts[0] != 0:
        return None
    if len(starts) < n:
        return _MORE
    lengths = a[starts].astype(np.int64) + (a[starts + 1].astype(np.int64) << 8)
    nxt = starts + 8 + lengths
    if not np.array_equal(nxt[:-1], starts[1:]):
        return None
    return int(nxt[-1])


def _tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    try:
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in shape:
        n *= d
    return n // block_size * type_size


def human_params(n: int) -> str:
    """A parameter count as Ollama writes it: ``"270M"``, ``"1.2B"``, ``"8B"``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)
