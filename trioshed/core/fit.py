"""Count-then-fit: the decisions that fit a request's prompt to a runner's context (pure).

The automatic context (:mod:`trioshed.core.context`) is sized from an upper bound on a request's
tokens (its ``need``), so a request whose bound fits its runner's context needs no count at all.
One whose bound does not (a prompt near or past the model's trained context, or a ``num_ctx``
set smaller) is counted exactly by a runner of its model (``/apply-template`` then
``/tokenize``: ~20 ms for 80 KB of text on gemma3 270M) before any answer is sent, so that even
a streamed request gets its protocol's 400 rather than a 200 that ends in an error event. The
scheduler performs these decisions (:mod:`trioshed.scheduler.fit`) at two moments:

- **Before the lease**, on the model's loaded runner, when the automatic context would
  otherwise reload it at a larger size (:func:`count_first`): a prompt the runner holds with its
  output budget is served there, one longer than the model takes is refused (ContextTooLong)
  without a load, and one between grows the context to the bucket of its exact count, not of
  the byte bound (:func:`sized_by_count`).
- **On the lease**, for a request not counted before whose bound its runner's slot does not
  hold (:func:`must_count`; a ``num_ctx`` set smaller than a larger runner's that serves it
  bounds it instead, :func:`within`): a prompt the slot holds is served; one that it does not is a 400,
  unless the automatic context was made smaller to fit the memory (the scheduler's ``floor``,
  the lease's :class:`~trioshed.core.context.Shrunk`): then it grows the runner to the bucket of
  its count where the larger size would only have split the model with system memory, and is
  a 507 (ContextOutOfMemory) naming its tokens and the memory where every size between was just
  found not to fit; one longer than the size asked for (the model's trained context) is the 400
  as before (:func:`regrow_to`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trioshed.core.context import FLOOR, PER_MESSAGE, Shrunk, bucket, slot_context
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.core.sched import RunnerView, can_serve
from trioshed.errors import ContextOutOfMemory, ContextTooLong


@dataclass(frozen=True)
class Sizing:
    """How to lease a request once its prompt was counted up front, or found not to need it."""

    options: RunnerOptions
    need: int  # the upper bound its lease's slot must hold, or be counted (0: counted already)
    floor: int  # the smallest automatic num_ctx it may be loaded at (0: never lowered)


def uncounted(options: RunnerOptions, need: int, automatic: bool) -> Sizing:
    """A request not counted up front: leased as asked; an automatic size may be made as small
    as :data:`~trioshed.core.context.FLOOR` to fit the memory (counted on its lease then)."""
    return Sizing(options, need, min(FLOOR, options.num_ctx) if automatic else 0)


def count_first(loaded: RunnerView | None, model: ModelSpec, options: RunnerOptions, automatic: bool) -> RunnerOptions | None:
    """The options to count a request on the model's ``loaded`` runner with, before its lease:
    when its automatic context is larger than the runner's (it would reload the model) and the
    runner serves it at its own size. None: no count up front (nothing loaded, a ``num_ctx``
    set, a runner that holds the size asked already or that could not serve it anyway)."""
    if not automatic or loaded is None or loaded.options.num_ctx >= options.num_ctx:
        return None
    on_loaded = replace(options, num_ctx=loaded.options.num_ctx)
    return on_loaded if can_serve(loaded, model, on_loaded) else None


def sized_by_count(tokens: int, options: RunnerOptions, on_loaded: RunnerOptions, output: int) -> Sizing:
    """A request whose prompt the loaded runner counted as ``tokens``: served there when it holds
    them and the ``output`` budget, else grown to the bucket of the count (never past the size
    asked for, and never made smaller than that to fit the memory). Raises ContextTooLong when
    even the size asked for (the model's trained context) cannot hold the prompt."""
    if tokens >= slot_context(options):
        raise ContextTooLong(tokens, slot_context(options))
    if tokens + output < slot_context(on_loaded):
        return Sizing(on_loaded, 0, on_loaded.num_ctx)
    grown = replace(options, num_ctx=min(options.num_ctx, bucket(tokens + output + PER_MESSAGE)))
    return Sizing(grown, 0, grown.num_ctx)


def within(runner: RunnerOptions, asked: RunnerOptions, automatic: bool) -> RunnerOptions:
    """The options whose slot bounds a request's prompt on its lease: the runner's, or the
    request's own where it set a smaller context (``num_ctx`` in ``models.toml``, a Modelfile or
    the request) and a larger runner of the same file serves it without a reload
    (:func:`~trioshed.core.views.can_serve`). The request is then held to the size it was given,
    as it would be on a runner of that size: a longer prompt is a 400 rather than served
    whenever a larger runner happens to be loaded. An automatic size is only a bound: the
    runner's whole slot is the request's."""
    if automatic or slot_context(asked) >= slot_context(runner):
        return runner
    return asked


def must_count(need: int, options: RunnerOptions) -> bool:
    """Whether a request of at most ``need`` tokens must be counted on a runner with ``options``
    (its bound is more than one slot holds)."""
    return need > slot_context(options)


def regrow_to(tokens: int, options: RunnerOptions, shrunk: Shrunk | None, output: int, model: ModelSpec) -> int | None:
    """A request counted on its lease (a runner with ``options``) as ``tokens``: None when the
    slot holds its prompt (served there), else the ``num_ctx`` to grow the runner to, where its
    size was made smaller than asked (``shrunk``) only because the larger would have spilled.
    Raises ContextTooLong when no size the request may have holds the prompt, and
    ContextOutOfMemory (507) where a size that would is one just found not to fit the memory."""
    n_ctx = slot_context(options)
    if tokens < n_ctx:
        return None
    if shrunk is None:
        raise ContextTooLong(tokens, n_ctx)
    asked = slot_context(replace(options, num_ctx=shrunk.asked))
    if tokens >= asked:
        raise ContextTooLong(tokens, asked)
    if not shrunk.fits_larger:  # every size up to the one asked was just found not to fit
        raise ContextOutOfMemory(model.name, tokens, n_ctx, shrunk.tried, shrunk.why)
    return min(shrunk.asked, bucket(tokens + max(PER_MESSAGE, output)))
