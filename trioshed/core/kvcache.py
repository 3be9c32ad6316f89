"""Warm returns, decided: which saved slot a runner may restore, for which prompt, and which
saved files make room for a new one. No I/O, no trio (the store and the runner do those).

When trioshed unloads a runner, llama-server saves each slot that holds a conversation
(``POST /slots/{id}?action=save``: the slot's tokens, then its KV cache). When the model comes
back, a request whose prompt continues a saved conversation gets that slot restored before it is
sent, so that llama-server recomputes only the new part.

What a file may be restored into
    A slot file is raw KV cache: llama-server accepts it into any runner whose cache has the same
    shapes (measured on b10068: a file saved by one random tiny model is restored into another of
    the same shape without complaint, and the answer is garbage), and refuses it only for other
    shapes or a context smaller than its tokens. So trioshed keys every file by a
    :class:`CacheKey`: the model file's identity (path, size, modification time and a digest of
    sampled bytes, which tells two models of the same shape apart without reading gigabytes),
    the adapters and projector the same way, the KV cache type, flash attention (it changes the
    V layout) and ``--swa-full`` (without it a sliding-window layer's cache holds only the window).
    A file is restored only into a runner with the same key and a per-slot context at least as
    long as its tokens.

How a request is matched: tokens, not a hash of the rendered prompt
    llama-server reuses exactly the common token prefix of a slot's cache and the new prompt.
    The slot file starts with the tokens it holds (:func:`slot_file_tokens`), so comparing them
    with the request's tokens predicts exactly what will be reused, for every endpoint (raw
    prompts, chat templates rendered by llama-server or by trioshed) and measures partial
    overlap too: the conversation's history is matched even though the saved slot also holds the
    model's last answer, which the next prompt re-renders differently at its end. A hash of the
    rendered prompt prefix would need trioshed to render exactly what llama-server renders, and
    could only say "equal up to the point hashed". The price: tokenizing the request on the
    runner (``/apply-template`` and ``/tokenize``, a few milliseconds), paid only on a runner
    that still has an unused slot and a saved file with its key.

Disk budget
    Files are evicted least recently used first (:func:`plan_room`); a file larger than the whole
    budget is not kept.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_MATCH_TOKENS",
    "CacheKey",
    "FileIdentity",
    "Match",
    "SavedSlot",
    "choose_restore",
    "common_prefix",
    "entry_name",
    "plan_room",
    "sample_ranges",
    "slot_file_tokens",
]

#: llama.cpp's ``LLAMA_STATE_SEQ_MAGIC`` ('ggsq') and ``LLAMA_STATE_SEQ_VERSION`` in b10068.
SLOT_FILE_MAGIC = 0x67677371
SLOT_FILE_VERSION = 2
#: A restore must save at least this many tokens of prompt processing to be worth a file read.
MIN_MATCH_TOKENS = 32
#: Bytes read at each sampled offset of a model file for its identity.
SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True)
class FileIdentity:
    """A file as it is now: ``sample`` is a digest of :func:`sample_ranges`' bytes."""

    path: str
    size: int
    mtime_ns: int
    sample: str


def sample_ranges(size: int, length: int = SAMPLE_BYTES) -> tuple[tuple[int, int], ...]:
    """(offset, length) of the bytes whose digest identifies a file of ``size`` bytes: its start
    (the GGUF header), middle and end (tensor data, where two models of one shape differ)."""
    if size <= 3 * length:
        return ((0, size),)
    return ((0, length), (size // 2 - length // 2, length), (size - length, length))


@dataclass(frozen=True)
class CacheKey:
    """What a saved slot depends on; equal keys (same :attr:`id`) may exchange slot files."""

    model: FileIdentity
    adapters: tuple[FileIdentity, ...] = ()
    projector: FileIdentity | None = None
    kv_cache_type: str = "f16"
    flash_attention: bool = False
    swa_full: bool = False

    @property
    def id(self) -> str:
        """16 hex digits naming the key in file names."""
        canonical = json.dumps(
            [self.model, self.adapters, self.projector, self.kv_cache_type, self.flash_attention, self.swa_full],
            default=lambda f: [f.path, f.size, f.mtime_ns, f.sample],
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SavedSlot:
    """One saved slot file in the store (``name`` + ``.bin``), as its sidecar describes it."""

    name: str
    key_id: str
    tokens: Sequence[int]  # an array('i'): 4 bytes a token held in memory, not a tuple's 36
    size: int
    checksum: int  # zlib.crc32 of the whole file
    saved_at: float
    used_at: float


@dataclass(frozen=True)
class Match:
    """The saved slot to restore for a request, and how many of its tokens the request reuses."""

    entry: SavedSlot
    reused: int


def slot_file_tokens(head: bytes) -> array[int]:
    """The tokens at the start of a slot file (``magic, version, n_tokens, tokens[n]``, little
    endian ``u32``/``i32``), as an ``array('i')``: the store holds every saved file's tokens in
    memory. Raises ValueError when ``head`` is not such a file or is cut short."""
    if len(head) < 12:
        raise ValueError("not a slot file: shorter than its header")
    magic, version, n = struct.unpack_from("<III", head)
    if magic != SLOT_FILE_MAGIC:
        raise ValueError(f"not a slot file: magic {magic:#x}")
    if version != SLOT_FILE_VERSION:
        raise ValueError(f"slot file version {version}, this build writes {SLOT_FILE_VERSION}")
    if len(head) < 12 + 4 * n:
        raise ValueError(f"slot file cut short: {n} tokens announced")
    tokens = array("i", head[12 : 12 + 4 * n])
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def entry_name(key_id: str, tokens: Sequence[int]) -> str:
    """The file name (without suffix) of ``tokens`` saved under ``key_id``: the same
    conversation saved twice replaces its file."""
    digest = hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:16]
    return f"{key_id}-{digest}"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choose_restore(
    entries: Iterable[SavedSlot],
    key_id: str,
    n_ctx_slot: int,
    prompt: Sequence[int],
    min_tokens: int = MIN_MATCH_TOKENS,
) -> Match | None:
    """The saved slot sharing the longest token prefix with ``prompt`` (the most recently used
    one among equals), or None when none shares ``min_tokens``. Only files of ``key_id`` whose
    tokens fit a slot of ``n_ctx_slot`` cells are candidates."""
    best: Match | None = None
    for e in entries:
        if e.key_id != key_id or len(e.tokens) > n_ctx_slot:
            continue
        reused = common_prefix(e.tokens, prompt)
        if reused < min_tokens:
            continue
        if best is None or (reused, e.used_at) > (best.reused, best.entry.used_at):
            best = Match(e, reused)
    return best


def plan_room(entries: Iterable[SavedSlot], budget: int, incoming: int) -> tuple[str, ...] | None:
    """Names of the files to delete, least recently used first, so that ``incoming`` more bytes
    stay within ``budget``; None when ``incoming`` alone exceeds it (the save is skipped)."""
    if incoming > budget:
        return None
    ordered = sorted(entries, key=lambda e: (e.used_at, e.name))
    used = sum(e.size for e in ordered)
    drop: list[str] = []
    for e in ordered:
        if used + incoming <= budget:
            break
        drop.append(e.name)
        used -= e.size
    return tuple(drop)
