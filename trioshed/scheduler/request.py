"""A request as the scheduler holds it, from admission until it has a runner or an error.

A request waits (:class:`~trioshed.core.queue.Waiting`) until the planner decides for it: ``done``
is set with ``runner`` or ``error``. Its ``view`` is what the planner sees of it
(:class:`~trioshed.core.views.RequestView`, cached until a field it carries changes). A request
queued again (its runner died, failed its ping, or was too small) keeps its id, arrival and share
(:meth:`Request.again`). ``floor``, ``floor_estimate`` and ``shrunk`` carry the context-shrink
policy's state (:mod:`trioshed.core.shrink`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from trioshed.core.context import Shrunk
from trioshed.core.model import MemoryEstimate, ModelSpec, RunnerOptions
from trioshed.core.views import RequestView
from trioshed.errors import TrioshedError
from trioshed.keys import ANONYMOUS, ApiKey
from trioshed.scheduler.runner import Runner


@dataclass(eq=False)
class Request:
    id: int
    model: ModelSpec
    options: RunnerOptions
    keep_alive: float
    estimate: MemoryEstimate
    done: trio.Event = field(default_factory=trio.Event)
    runner: Runner | None = None
    error: TrioshedError | None = None
    load_duration: float = 0.0
    idle_for: float = 0.0  # how long the runner it was handed had been idle (0: busy or fresh)
    room_wait: str = ""  # why it waits for memory, as last logged ("" = it has not)
    arrived: float = field(default_factory=time.time)  # wall clock: the status page's oldest wait
    held_since: float | None = None  # when its swap was first held for another model's queue
    key: ApiKey = ANONYMOUS  # whose request: its tenant and weight
    share: float = 0.0  # its start tag in the fair order between tenants
    queued_at: float = 0.0  # Trio's clock: when it reached the scheduler (priority ages from it)
    retries: int = 0  # how many times it was queued again (its runner died or failed its ping)
    floor: int = 0  # the smallest automatic num_ctx it may be loaded at (0: num_ctx set, never lowered)
    floor_estimate: MemoryEstimate | None = None  # its estimate at that size
    shrunk: Shrunk | None = None  # where its automatic context was made smaller, and why
    #: an adapter-model's estimate with only its own adapters, at given options (None: its
    #: group's runner holds no other model's): ``RequestView.alone_estimate``
    alone: Callable[[RunnerOptions], MemoryEstimate] | None = None

    @functools.cached_property
    def view(self) -> RequestView:
        return RequestView(
            self.id, self.model, self.options, self.estimate, priority=self.model.priority,
            held_since=self.held_since, tenant=self.key.name, share=self.share, arrived=self.queued_at,
            floor_estimate=self.floor_estimate if self.options.num_ctx > self.floor else None,
            alone_estimate=self.alone(self.options) if self.alone is not None else None,
        )  # fmt: skip

    @property
    def again_of(self) -> bool:
        """Whether this is a request queued again (its runner died, or failed its ping)."""
        return self.retries > 0

    def again(self) -> Request:
        """This request, to be queued again: the same id, arrival and share; nothing decided."""
        return Request(
            self.id, self.model, self.options, self.keep_alive, self.estimate, arrived=self.arrived,
            held_since=self.held_since, key=self.key, share=self.share, queued_at=self.queued_at,
            retries=self.retries + 1, floor=self.floor, floor_estimate=self.floor_estimate, shrunk=self.shrunk,
            alone=self.alone,
        )  # fmt: skip

    def held(self, now: float) -> None:
        if self.held_since is None:
            self.held_since = now
            self.forget_view()  # the cached view carries it

    def forget_view(self) -> None:
        """Its options, estimate or floor changed: the planner's view is made again."""
        self.__dict__.pop("view", None)
