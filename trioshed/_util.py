"""Small helpers shared across packages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
