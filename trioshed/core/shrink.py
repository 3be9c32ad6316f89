"""When a request's automatic context does not fit: the next size to try, and what to answer
where none is left (pure).

:mod:`trioshed.core.context` draws the policy (buckets, the floor, :class:`Shrunk`); this module
decides each step of it for the scheduler, which performs what it returns (estimates the memory
of the size returned, queues the request again at it, or fails it):

* the planner refused a size (its 507, or a smaller size preferred where this one would spill
  layers to system memory or evict other models): :func:`after_refusal` gives the next smaller
  size, and the :class:`Shrunk` the lease will carry (``fits_larger``: that size would load, with
  layers in system memory, so a request the smaller runner does not hold may grow back to it);
* llama.cpp ran out of memory loading a size (:func:`out_of_memory_line` finds its own words):
  :func:`retries_smaller` says whether any of the load's waiters may be tried smaller (else the
  load fails as any other, with a back-off); of each waiter, a request that asked a smaller size
  than the load stays queued for its own (:func:`stays_queued`), the others are tried at the
  next size (:func:`smaller`, why: :data:`RAN_OUT`), or get :func:`out_of_memory_failure` (the
  507 at their floor).

A ``num_ctx`` set by the user (floor 0) is never lowered. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from trioshed.core.context import Shrunk, out_of_memory, smaller_context
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import (
    InsufficientMemory,
    LoadFailed,
    LoadOutOfMemory,
    SmallerContextPreferred,
    TrioshedError,
)

#: Why a size was left after llama.cpp ran out of memory loading it (the log and the Shrunk).
RAN_OUT = "llama.cpp ran out of memory loading it"


@dataclass(frozen=True)
class Smaller:
    """The next size to try: the options at it, and what the lease will say of it."""

    options: RunnerOptions
    shrunk: Shrunk


def sized(options: RunnerOptions, num_ctx: int) -> RunnerOptions:
    """``options`` at a context of ``num_ctx`` (the batch at most the context)."""
    return replace(options, num_ctx=num_ctx, num_batch=min(options.num_batch, num_ctx))


def floor_of(options: RunnerOptions, floor: int) -> int:
    """The smallest size a request asking ``options`` may be made (0: not at all)."""
    return min(floor, options.num_ctx)


def at_floor(options: RunnerOptions, floor: int) -> RunnerOptions | None:
    """``options`` at the request's floor, whose memory the planner weighs against its own size
    (None: it may not be made smaller)."""
    return sized(options, floor) if 0 < floor < options.num_ctx else None


def smaller(options: RunnerOptions, floor: int, shrunk: Shrunk | None, why: str, *, fits_larger: bool = False) -> Smaller | None:
    """The next size below ``options.num_ctx`` (which did not fit: ``why``), down to ``floor``;
    None when nothing smaller is allowed. ``shrunk``: where the request was made smaller before
    (the size it asked is kept)."""
    num_ctx = smaller_context(options.num_ctx, floor)
    if num_ctx is None:
        return None
    asked = shrunk.asked if shrunk else options.num_ctx
    return Smaller(sized(options, num_ctx), Shrunk(asked, options.num_ctx, why, fits_larger))


def after_refusal(error: TrioshedError, options: RunnerOptions, floor: int, shrunk: Shrunk | None) -> Smaller | None:
    """The planner refused ``options`` with ``error``: the next size, where it is a want of
    memory and the floor allows (None: the request fails with ``error``, or, see
    :func:`loads_split`, is planned at its own size)."""
    if not isinstance(error, InsufficientMemory):
        return None
    return smaller(options, floor, shrunk, memory_words(error), fits_larger=isinstance(error, SmallerContextPreferred))


def loads_split(error: TrioshedError) -> bool:
    """Whether a refusal that found no smaller size is no refusal at all: a smaller size was
    only preferred, and the request is planned at its own size (layers in system memory)."""
    return isinstance(error, SmallerContextPreferred)


def memory_words(error: InsufficientMemory) -> str:
    """The memory an InsufficientMemory names, in a few words (a smaller context's log and 507)."""
    if isinstance(error, SmallerContextPreferred):
        return error.reason
    if error.needed and error.available:
        return f"an estimated {_gib(error.needed)} needed, {_gib(error.available)} available"
    return error.message


def out_of_memory_line(error: LoadFailed, model: ModelSpec) -> str:
    """llama.cpp's own line saying that a load of ``model`` ran out of memory (its output
    first), the file's path replaced by the model's name: no path reaches a client. "": it did
    not run out of memory."""
    line = out_of_memory(f"{error.stderr_tail}\n{error.message}")
    return line.replace(model.path, f"<{model.name}>") if line else ""


def retries_smaller(waiters: Iterable[tuple[RunnerOptions, int]], loaded: RunnerOptions) -> bool:
    """Whether any of a load's waiters (their options and floor) that ran out of memory at
    ``loaded`` may be served at a smaller size: one with an automatic context, or one that asked
    less than the load (it joined a larger load)."""
    return any(floor or options.num_ctx < loaded.num_ctx for options, floor in waiters)


def stays_queued(options: RunnerOptions, loaded: RunnerOptions) -> bool:
    """A waiter that asked less than the load that ran out of memory (it joined a larger load):
    it stays queued for its own size, still to be tried."""
    return options.num_ctx < loaded.num_ctx


def out_of_memory_failure(model: ModelSpec, options: RunnerOptions, floor: int, line: str, error: LoadFailed) -> TrioshedError:
    """What a waiter of a load that ran out of memory gets where no smaller size is left: a 507
    naming its size and llama.cpp's ``line`` when its context was automatic, else the load's own
    ``error``."""
    return LoadOutOfMemory(model.name, options.num_ctx, line) if floor else error


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
