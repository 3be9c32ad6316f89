"""The context-shrink policy (:mod:`trioshed.core.shrink`), performed on the waiting requests.

The policy decides; :class:`Resizer` acts: it estimates the memory of the next size (a cached
GGUF header read), makes the waiting request that size (its options, estimate and
:class:`~trioshed.core.context.Shrunk`), logs it, and has the scheduler plan again; where the
policy has no size left, the request is answered with the policy's refusal. Two moments ask it:
a planning pass refused a size (:meth:`Resizer.after_refusal`), and llama.cpp ran out of memory
loading one (:meth:`Resizer.after_out_of_memory`). Before either, a request learns how small it
may be made (:meth:`Resizer.set_floor`); one whose prompt a smaller runner did not hold asks for a
larger one again (:meth:`Resizer.resized`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress

from trioshed.core import shrink
from trioshed.core.queue import Waiting
from trioshed.core.views import can_serve
from trioshed.errors import LoadFailed, TrioshedError
from trioshed.models.gguf_meta import unreadable
from trioshed.scheduler.request import Request
from trioshed.scheduler.runner import Estimator, Runner

log = logging.getLogger(__name__)


class Resizer:
    """Makes waiting requests smaller as the policy says; the scheduler owns it.

    ``waiting``: the scheduler's waiting list (read); ``wake``: a change for the planner;
    ``fail``: answer a request with an error; ``record``: the scheduler's record of events
    (tests), or None."""

    def __init__(
        self,
        estimator: Estimator,
        waiting: Waiting[Request],
        *,
        wake: Callable[[], None],
        fail: Callable[[Request, TrioshedError], None],
        record: list[tuple[str, str]] | None,
    ) -> None:
        self._estimator = estimator
        self._waiting = waiting
        self._wake = wake
        self._fail = fail
        self._record = record

    def set_floor(self, req: Request, floor: int) -> None:
        """``req`` may be made as small as ``floor`` (0: not at all): its estimate there, for the
        planner to see whether a smaller size keeps its layers on the GPUs."""
        req.floor = shrink.floor_of(req.options, floor)
        req.floor_estimate = None
        if (smallest := shrink.at_floor(req.options, req.floor)) is not None:
            with suppress(OSError, ValueError):  # read at admission already: cached
                req.floor_estimate = self._estimator(req.model, smallest)
        req.forget_view()  # the cached view carries it

    def resized(self, req: Request, num_ctx: int) -> Request:
        """``req`` again, to be queued for a runner at ``num_ctx`` (the bucket of its exact
        count), never smaller. Raises the 500 of an unreadable model file."""
        again = req.again()
        again.options = shrink.sized(req.options, num_ctx)
        try:
            again.estimate = self._estimator(again.model, again.options)
        except (OSError, ValueError) as exc:
            raise unreadable(again.model.name, again.model.path, exc) from None
        again.shrunk = None
        self.set_floor(again, num_ctx)
        return again

    def after_refusal(self, req: Request, error: TrioshedError) -> bool:
        """The planner refused ``req``'s size with ``error``: place it once more at the next
        smaller size, or at its own size where a smaller one was only preferred and there is
        none (it loads with layers in system memory). Whether either was done (if not, the
        request is to fail with ``error``)."""
        if self.shrink(req, shrink.after_refusal(error, req.options, req.floor, req.shrunk)):
            return True
        if shrink.loads_split(error):  # no smaller size after all: load it split
            req.floor_estimate = None
            req.forget_view()
            self._wake()
            return True
        return False

    def after_out_of_memory(self, runner: Runner, error: LoadFailed) -> bool:
        """A load failed: when llama.cpp ran out of memory, its waiters that asked a smaller
        context than the runner's (they joined a larger load) stay queued for their own size;
        the others with an automatic context are placed once more at a smaller one, or get a
        507 (LoadOutOfMemory) at their floor, and those with a size set fail with ``error``.
        Whether any was automatic or smaller (if not, nothing was done: the caller fails them
        all, with a cooldown; smaller sizes are still to be tried instead, and a request that
        needs less is not turned away meanwhile)."""
        line = shrink.out_of_memory_line(error, runner.model)  # llama.cpp's own line, no path
        if not line:
            return False
        waiters = [
            req for req in self._waiting
            if req.model.path == runner.model.path and can_serve(runner.view(), req.model, req.options)
        ]  # fmt: skip
        if not shrink.retries_smaller(((req.options, req.floor) for req in waiters), runner.options):
            return False
        for req in waiters:
            if shrink.stays_queued(req.options, runner.options):
                continue  # it joined a larger load: its own size is still to be tried
            if self.shrink(req, shrink.smaller(req.options, req.floor, req.shrunk, shrink.RAN_OUT)):
                continue
            self._fail(req, shrink.out_of_memory_failure(req.model, req.options, req.floor, line, error))
        self._wake()
        return True

    def shrink(self, req: Request, smaller: shrink.Smaller | None) -> bool:
        """Place ``req`` once more at the ``smaller`` size the policy gave (its load did not fit,
        ran out of memory, or would spill layers to system memory where a smaller one would not);
        whether it was (not where there is none, or its memory cannot be estimated)."""
        if smaller is None:
            return False
        try:
            estimate = self._estimator(req.model, smaller.options)
        except (OSError, ValueError):
            return False
        log.info(
            "%s at context %d does not fit (%s); trying context %d",
            req.model.name, req.options.num_ctx, smaller.shrunk.why, smaller.options.num_ctx,
        )  # fmt: skip
        req.shrunk = smaller.shrunk
        req.options, req.estimate, req.room_wait = smaller.options, estimate, ""
        req.forget_view()  # the cached view carries the options
        if self._record is not None:
            self._record.append(("smaller context", req.model.short_name))
        self._wake()
        return True
