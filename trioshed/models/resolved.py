"""Names resolved before, kept while nothing they depend on has changed.

Resolving a name reads the store: which folders are Ollama stores, ``models.toml``, the file, the
folder's projector pairing, the file's header for a projector, then builds the model's spec. Most
requests name a model resolved a moment before, and nothing changed since. A plain model file of
a folder store (``NAME.gguf``, not a ``models.toml`` entry nor a sub-folder) is kept here with
the *version* of everything its spec follows: each store folder and its ``pulled/`` folder (a
file or folder added, removed or renamed in one changes its mtime: a model copied in, another
folder's file that would now win the name, a projector), each ``models.toml`` and the file
itself. A lookup stats those again (a few system calls) and gives the kept spec only when all
are as they were.

Filesystems stamp times from a coarse clock (a few milliseconds): two changes within one tick
can leave the same mtime. A version younger than :data:`SETTLED_NS` is therefore never kept (as
git treats a "racily clean" index entry), so that any later change has a later stamp.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from trioshed.core.model import ModelSpec

#: A version is kept once everything in it is at least this old (nanoseconds).
SETTLED_NS = 200_000_000
#: Names kept at most (a name's spellings each count): the cache is emptied beyond.
MAX_NAMES = 1024

Version = tuple[tuple[int, ...] | None, ...]


def settled(mtime_ns: int) -> bool:
    """Whether a stamp is old enough that a later change cannot leave it as it is."""
    return mtime_ns <= time.time_ns() - SETTLED_NS


def _stamp(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size, st.st_dev)


class Resolved:
    """The specs of plain model files, by the name asked, with their versions (module docstring).

    ``paths``: the folders and files every version covers (the store folders, their ``pulled/``
    and ``models.toml``), besides each spec's own file."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = tuple(paths)
        self._kept: dict[str, tuple[Version, ModelSpec]] = {}

    def version(self, spec: ModelSpec) -> Version:
        return (*(_stamp(p) for p in self._paths), _stamp(spec.path))

    def get(self, name: str) -> ModelSpec | None:
        """The spec kept for ``name`` if nothing it follows has changed, else None."""
        kept = self._kept.get(name)
        if kept is None:
            return None
        version, spec = kept
        if self.version(spec) == version:
            return spec
        del self._kept[name]
        return None

    def keep(self, name: str, spec: ModelSpec) -> None:
        """Keep ``spec`` (a plain model file's) for ``name``, unless its version is too recent to
        be told from a change in the same clock tick, or its file is gone."""
        version = self.version(spec)
        if version[-1] is None:
            return
        if not settled(max((stamp[0] for stamp in version if stamp is not None), default=0)):
            return
        if len(self._kept) >= MAX_NAMES:
            self._kept.clear()
        self._kept[name] = (version, spec)
