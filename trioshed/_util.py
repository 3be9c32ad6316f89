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
