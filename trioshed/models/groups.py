"""Adapter groups of the stores: the models that share one runner (see :mod:`trioshed.core.adapters`).

A request names one model; the runner that serves it loads the adapters of every model on the
same base file with the same runner settings, so that the next request for a sibling finds them
loaded. :class:`Groups` keeps the store's index of those groups (:func:`group_index`: which
adapters each base carries) and gives a resolved model its group (``ModelSpec.group``).

The base is identified by its file, not its name: a ``models.toml`` entry, a created model (an
Ollama manifest's blob) and a plain ``NAME.gguf`` are one base when they are the same file
(device and inode: a hard link or a symlink to it is the same file; a copy, or another
quantisation, is not). The projector is part of the key the same way; so are the settings that
start a runner (``args``, ``num_parallel``, ``speculation``, ``draft``).

When the index is made again: when a ``models.toml`` or a store folder changes (their stamps,
a few stats a lookup), when this process writes or removes a manifest (:func:`store_changed`:
create, pull, copy, delete), and at most :data:`REFRESH` seconds after it was made (an adapter-model
another program adds to an Ollama store). An index that lags costs at most a load, never a wrong
answer: a model's own adapters are always in its runner's (:func:`trioshed.core.adapters.group_of`),
and a runner that lacks them is never handed its requests.

Blocking (files): the index is made on the caller's thread, microseconds when kept.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from trioshed.core.model import ModelSpec

__all__ = ["REFRESH", "Group", "GroupKey", "Groups", "group_index", "store_changed"]

#: Seconds an index is kept at most (changes made by another program to an Ollama store).
REFRESH = 2.0

#: A base file's identity (device, inode, size, mtime) with the runner settings a group shares.
GroupKey = tuple[object, ...]

_changes = itertools.count()
_generation = 0


def store_changed() -> None:
    """A manifest was written or removed by this process: indexes are made again."""
    global _generation
    _generation = next(_changes) + 1


def _identity(path: str | None) -> tuple[int, int, int, int] | None:
    if not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def group_key(spec: ModelSpec, identity: Callable[[str | None], object] = _identity) -> GroupKey | None:
    """The key of ``spec``'s group (None: its base file cannot be read)."""
    base = identity(spec.path)
    if base is None:
        return None
    return (base, identity(spec.projector), spec.args, spec.num_parallel, spec.speculation, spec.draft)


@dataclass(frozen=True)
class Group:
    """One group: its adapters in a stable order, and its spelling of the base file and
    projector (the first model's, by name), which every member's runner is started from."""

    adapters: tuple[str, ...]
    path: str
    projector: str | None


def group_index(members: Iterable[tuple[GroupKey, ModelSpec]]) -> dict[GroupKey, Group]:
    """Each group's adapters, in a stable order: the models by name, each one's adapters in its
    order, each file once. Groups without an adapter are left out. Pure."""
    index: dict[GroupKey, tuple[list[str], ModelSpec]] = {}
    for key, spec in sorted(members, key=lambda m: m[1].name):
        if spec.adapters:
            adapters, _ = index.setdefault(key, ([], spec))
            adapters += [a for a in spec.adapters if a not in adapters]
    return {k: Group(tuple(a), first.path, first.projector) for k, (a, first) in index.items()}


class Groups:
    """The stores' group index, made again when they change (see the module docstring).

    ``specs``: the adapter-models of the stores, and whether an Ollama store is among them (one
    that another program may change: then the index is made again after :data:`REFRESH`);
    ``stamps``: the paths whose stamps say that the stores changed (their folders and
    ``models.toml`` files)."""

    def __init__(
        self, specs: Callable[[], tuple[Sequence[ModelSpec], bool]], stamps: Sequence[str], *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._specs = specs
        self._stamps = tuple(stamps)
        self._clock = clock
        self._refresh = REFRESH
        self._lock = threading.Lock()
        self._index: dict[GroupKey, Group] = {}
        self._version: tuple[object, ...] | None = None
        self._made_at = -float("inf")

    def _current_version(self) -> tuple[object, ...]:
        return (_generation, *(_identity(p) for p in self._stamps))

    def index(self) -> dict[GroupKey, Group]:
        """The index as it is now (made again if the stores changed or it is old)."""
        version = self._current_version()
        now = self._clock()
        if version == self._version and now - self._made_at < self._refresh:
            return self._index
        with self._lock:
            members = []
            specs, volatile = self._specs()
            self._refresh = REFRESH if volatile else float("inf")
            for spec in specs:
                key = group_key(spec)
                if key is not None:
                    members.append((key, spec))
            self._index = group_index(members)
            self._version, self._made_at = version, now
            return self._index

    def attach(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` with its group (unchanged when its base has no adapter-model)."""
        index = self.index()
        if not index and not spec.adapters:
            return spec
        key = group_key(spec)
        group = index.get(key) if key is not None else None
        if group is None or group.adapters == spec.group:
            return spec
        assert key is not None
        base = key[0]
        assert isinstance(base, tuple)
        return replace(spec, group=group.adapters, path=group.path, projector=group.projector, base=base)
