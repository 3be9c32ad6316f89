"""A model's GGUF header as the rest of trioshed asks for it: through the one cache, from the
event loop without blocking it, and the few facts derived from a header that are asked for often.

The headers themselves are cached in one place, :func:`trioshed.models.gguf_meta.read_metadata`,
by the file's identity (path, size, mtime). This module adds the ways in:

* :func:`header_of`: a model's header, synchronously (a dict look-up when cached: the model's
  identity as the store resolved it is the key, so a hit costs no system call); blocking on a
  miss (gemma3-270m: ~40 ms), so the event loop calls it only where a miss is rare or allowed;
* :func:`read_header`: the same for the event loop: a miss is parsed in a worker thread;
* :func:`writes_text`: whether the model writes text, once per header (it scans the tensor
  names, 30 µs on gemma3, asked by every request's runner options);
* :func:`listing_facts`: architecture, parameter size and quantization, a few bytes per file
  for model listings: a store of thousands lists from memory with one stat per model, more
  files than the header cache holds.
"""

from __future__ import annotations

import functools
import os

import trio

from trioshed.core.model import ModelSpec
from trioshed.models.capabilities import generates
from trioshed.models.gguf_meta import GGUFMetadata, cached_metadata, human_params, read_metadata

__all__ = ["header_of", "listing_facts", "read_header", "writes_text"]


def header_of(spec: ModelSpec) -> GGUFMetadata:
    """``spec``'s GGUF header (blocking on a cache miss). Raises ``OSError`` or ``ValueError``
    (:class:`~trioshed.models.gguf_meta.GGUFError`) for a file that cannot be read."""
    return read_metadata(spec.path, size=spec.size, modified=spec.modified)


async def read_header(spec: ModelSpec) -> GGUFMetadata:
    """``spec``'s GGUF header, read in a worker thread on a cache miss. Raises as :func:`header_of`."""
    meta = cached_metadata(spec.path, size=spec.size, modified=spec.modified)
    if meta is not None:
        return meta
    return await trio.to_thread.run_sync(header_of, spec)


@functools.lru_cache(maxsize=64)
def writes_text(header: GGUFMetadata) -> bool:
    """Whether the model of ``header`` writes text (neither an embedding model nor a reranker:
    :func:`~trioshed.models.capabilities.generates`), once per header read."""
    return generates(header.fields, (t.name for t in header.tensors))


def listing_facts(path: str) -> tuple[str, str, str]:
    """(architecture, parameter size, quantization) of the GGUF file ``path`` as it is now.
    Blocking (a stat; the header on a miss). Raises as :func:`header_of`."""
    st = os.stat(path)
    return _listing_facts(path, (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=4096)
def _listing_facts(path: str, identity: tuple[int, int, int, int]) -> tuple[str, str, str]:
    del identity  # part of the cache key only: device, inode, mtime, size
    meta = read_metadata(path)
    return meta.architecture or "", human_params(meta.parameter_count), meta.quantization or ""
