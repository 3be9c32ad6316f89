"""Small helpers shared across packages."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


@contextmanager
def single_error(*types: type[BaseException]) -> Iterator[None]:
    """Re-raise the one error of ``types`` that a nursery wrapped in an ExceptionGroup.

    Trio nurseries always raise groups; callers of a resource (``open_llama_server``) expect the
    plain error. Applies only when the group holds exactly one such error and otherwise nothing
    but cancellations; any other group propagates unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        wanted = [e for e in leaves if isinstance(e, types)]
        if len(wanted) == 1 and all(e is wanted[0] or isinstance(e, trio.Cancelled) for e in leaves):
            raise wanted[0] from None
        raise


def read_toml(path: Path | str, what: str) -> dict[str, Any]:
    """The TOML file at ``path``; ValueError saying ``what`` it is, where, and what is wrong."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid TOML: {exc}") from None


class RingIndex:
    """The positions of a ring of ``size`` entries whose columns (arrays of numbers, lists of
    strings) the owner keeps: allocated once, so that a long-lived entry is not an object of its
    own among short-lived ones."""

    __slots__ = ("_next", "held", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.held = 0  # entries held, at most ``size``
        self._next = 0  # the position the next entry goes to

    def push(self) -> int:
        """The position for a new entry (the oldest's, once the ring is full)."""
        at = self._next
        self._next = (at + 1) % self.size
        self.held = min(self.held + 1, self.size)
        return at

    def last(self) -> int | None:
        """The newest entry's position (None while empty)."""
        return (self._next - 1) % self.size if self.held else None

    def positions(self) -> Iterator[int]:
        """The positions held, oldest first."""
        first = self._next - self.held
        return ((first + i) % self.size for i in range(self.held))
