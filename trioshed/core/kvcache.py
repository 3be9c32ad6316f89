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

What the index holds of each file: a chain of block hashes
    Holding every saved file's tokens costs 4 bytes a token for as long as the file is kept (a
    disk budget of many files of long conversations: megabytes). The index keeps instead, per
    file, a hash of each full block of :data:`BLOCK` tokens chained with the hash of the blocks
    before it (as vLLM's prefix cache does), :data:`HASH_BYTES` bytes each, and the tokens of the
    partial last block, all in one ``bytes``: 0.5 bytes a token. Two chains agree up to the first
    block where the sequences differ, so the shared prefix is counted to the block: exact when
    the file's tokens are all shared (its partial last block compared token by token), and
    otherwise short of the exact count by less than a block. The choice among files is the same
    at that resolution (longest, then most recently used). A 64-bit collision could only pick a
    file that shares less than counted: llama-server compares the tokens itself and reuses
    exactly what is shared, so a wrong pick costs time, never a wrong answer.

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
    "TokenChain",
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
#: Tokens a block of the index's hash chain covers, and the bytes of each block's hash.
BLOCK = 16
HASH_BYTES = 8
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
    #: the LoRA adapters applied to the slot's tokens (not those merely loaded beside them)...
    adapters: tuple[FileIdentity, ...] = ()
    projector: FileIdentity | None = None
    kv_cache_type: str = "f16"
    flash_attention: bool = False
    swa_full: bool = False
    #: ... at these scales (empty: 1.0 each)
    scales: tuple[float, ...] = ()

    @property
    def id(self) -> str:
        """16 hex digits naming the key in file names."""
        fields: list[object] = [self.model, self.adapters, self.projector, self.kv_cache_type, self.flash_attention, self.swa_full]
        if any(s != 1.0 for s in self.scales):
            fields.append(list(self.scales))  # (absent at 1.0: the ids of keys before scales)
        canonical = json.dumps(fields, default=lambda f: [f.path, f.size, f.mtime_ns, f.sample])
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class TokenChain:
    """A token sequence as the index holds it, in one ``bytes``: a :data:`HASH_BYTES`-byte hash of
    each full block of :data:`BLOCK` tokens chained with the blocks before it, then the tokens of
    the partial last block (fewer than :data:`BLOCK`, 4 bytes each, native order: the index is
    rebuilt from the files at every start)."""

    n: int
    data: bytes

    @classmethod
    def of(cls, tokens: Sequence[int]) -> TokenChain:
        held = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
        full = len(held) // BLOCK
        raw = memoryview(held).cast("B")
        step = BLOCK * held.itemsize
        data = bytearray()
        digest = b""
        for i in range(full):
            digest = hashlib.blake2b(raw[i * step : (i + 1) * step], digest_size=HASH_BYTES, key=digest).digest()
            data += digest
        data += raw[full * step :]
        return cls(len(held), bytes(data))

    @property
    def blocks(self) -> int:
        return self.n // BLOCK

    @property
    def chain(self) -> bytes:
        return self.data[: self.blocks * HASH_BYTES]

    @property
    def tail(self) -> array[int]:
        return array("i", self.data[self.blocks * HASH_BYTES :])

    def shared(self, other: TokenChain, other_tokens: Sequence[int]) -> int:
        """How many leading tokens this sequence shares with ``other`` (whose tokens are
        ``other_tokens``), to the block: equal block hashes, then this sequence's partial last
        block token by token when every full block of it is shared."""
        # Chained hashes agree up to the first block that differs and never after: bisect.
        lo, hi = 0, min(self.blocks, other.blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = (mid - 1) * HASH_BYTES
            if self.data[at : at + HASH_BYTES] == other.data[at : at + HASH_BYTES]:
                lo = mid
            else:
                hi = mid - 1
        reused = lo * BLOCK
        if lo == self.blocks and self.n > reused:
            tail = self.tail
            reused += common_prefix(tail, other_tokens[reused : reused + len(tail)])
        return reused


@dataclass(frozen=True, slots=True)
class SavedSlot:
    """One saved slot file in the store (``name`` + ``.bin``), as its sidecar describes it;
    ``tokens``: the file's tokens as a :class:`TokenChain` (not every token: see above)."""

    name: str
    key_id: str
    tokens: TokenChain
    size: int
    checksum: int  # zlib.crc32 of the whole file
    saved_at: float
    used_at: float

    @property
    def n_tokens(self) -> int:
        return self.tokens.n


@dataclass(frozen=True)
class Match:
    """The saved slot to restore for a request, and how many of its tokens the request reuses
    (to the block: see :meth:`TokenChain.shared`)."""

    entry: SavedSlot
    reused: int


def slot_file_tokens(head: bytes) -> array[int]:
    """The tokens at the start of a slot file (``magic, version, n_tokens, tokens[n]``, little
    endian ``u32``/``i32``), as an ``array('i')``. Raises ValueError when ``head`` is not such a file or is cut short."""
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
    """The saved slot sharing the longest token prefix with ``prompt``, counted to the block (the
    most recently used one among equals), or None when none shares ``min_tokens``. Only files of ``key_id`` whose
    tokens fit a slot of ``n_ctx_slot`` cells are candidates."""
    best: Match | None = None
    asked = TokenChain.of(prompt)
    for e in entries:
        if e.key_id != key_id or e.tokens.n > n_ctx_slot:
            continue
        reused = e.tokens.shared(asked, prompt)
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
