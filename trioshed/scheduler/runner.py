"""A runner as the scheduler holds it: the child's handle, its state, leases and cancel scopes.

A runner's life is two nested cancel scopes: ``scope`` (the whole life; cancelling it aborts a
load) and ``timer`` (the serving phase: its deadline is the keep-alive expiry, and cancelling it
is an unload). :mod:`trioshed.scheduler.lifetime` runs that life; this module only holds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import trio

from trioshed.core import views
from trioshed.core.adapter_turns import Turns
from trioshed.core.adapters import adapter_set, selects
from trioshed.core.model import MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.own_runner import DemandMeter
from trioshed.core.queue import RECENTLY_USED
from trioshed.core.views import RunnerState
from trioshed.errors import RunnerCrashed
from trioshed.runner.command import device_names
from trioshed.scheduler.contracts import RunnerHandle

#: Starts a child and yields its handle once ready; leaving the block stops it.
RunnerFactory = Callable[[ModelSpec, RunnerOptions, Placement], AbstractAsyncContextManager[RunnerHandle]]
Estimator = Callable[[ModelSpec, RunnerOptions], MemoryEstimate]


@dataclass(eq=False)
class Member:
    """A model a runner serves (an adapter group's runner serves several): its leases now, when
    it was last leased or released, and its latest request's keep-alive. It is warm while leased
    and for its keep-alive after."""

    model: ModelSpec
    keep_alive: float
    leases: int = 0
    last_used: float = 0.0
    turn: int = 0  # the runner's lease count at its latest lease (orders equal times)

    @property
    def expires(self) -> float:
        return math.inf if self.leases > 0 else self.last_used + self.keep_alive


@dataclass(eq=False)
class Runner:
    id: int
    model: ModelSpec
    options: RunnerOptions
    placement: Placement
    estimate: MemoryEstimate
    state: RunnerState = RunnerState.LOADING
    leases: int = 0
    evicting: bool = False
    keep_alive: float = 300.0
    pinned: bool = False  # never a victim: models.toml's pinned, or Scheduler.pin() for the session
    last_used: float = 0.0
    # scope: the whole life (cancelling it aborts a load); timer: the serving phase, whose deadline
    # is the keep-alive expiry and whose cancellation is an unload.
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    timer: trio.CancelScope = field(default_factory=lambda: trio.CancelScope(deadline=math.inf))
    served: int = 0
    stop_called: bool = False  # stop() was called
    came_back: bool = False  # views.RunnerView.came_back
    _usage: tuple[tuple[str, int], ...] | None = None
    handle: RunnerHandle | None = None  # set once the child is ready
    load_started: float = 0.0
    load_duration: float = 0.0
    crash: RunnerCrashed | None = None
    hung: str = ""  # why it was killed as hung ("": it was not)
    unload_reason: str = ""
    # Requests with this id or later may not take a slot: a request that arrived before them is
    # due to evict this runner (core.sched's Plan.closed, kept until the next planning pass).
    closed_from: float = math.inf
    # Requests sent to it that have not had the first byte of their answer yet, and the health
    # monitor's sleep (its deadline: the next check): a request waiting for its answer brings the
    # next check to at most ``answer_check`` seconds away (see ``Lease.waiting_for_answer``).
    awaiting: int = 0
    watch: trio.CancelScope | None = None
    answer_check: float = math.inf
    # Output relayed from it (bumped by its leases for every piece of an answer): the health
    # monitor's progress probe, so that a runner busy streaming is alive however slow its
    # /health (see ``trioshed.scheduler.lifetime``).
    progress: int = 0
    # Set by its lifetime task once the runner is gone: its child's exit seen and its crash (if
    # it crashed) recorded, or its life over. The edge waits on it, never polls.
    gone: trio.Event = field(default_factory=trio.Event)
    #: The models it served, by name (one, unless it is an adapter group's runner): which are
    #: warm (/api/ps lists each) and how long it stays (:meth:`stays_for`).
    members: dict[str, Member] = field(default_factory=dict)
    #: An adapter group's runner: the turns its adapter sets take (``core.adapter_turns``), and
    #: each set's demand on it (``core.own_runner``, fed by the planning pass).
    turns: Turns = field(default_factory=Turns)
    meter: DemandMeter = field(default_factory=DemandMeter)
    #: A runner of one model's own adapters beside its group's (``core.group_plan``).
    own: bool = False

    def lease(self, keep_alive: float, now: float, model: ModelSpec | None = None) -> None:
        """A request (for ``model``) takes a slot (at ``now``): the runner stays while leased,
        then for the latest keep-alive of each model it serves. Its clients came back when it
        was busy or used within :data:`~trioshed.core.queue.RECENTLY_USED` seconds (a swap
        waits for such clients)."""
        self.came_back = self.served > 0 and (self.leases > 0 or now - self.last_used <= RECENTLY_USED)
        self.leases += 1
        self.last_used = now
        self.keep_alive = keep_alive
        if self.timer.deadline != math.inf:  # (a scope's deadline moved costs a dozen calls)
            self.timer.deadline = math.inf
        self.served += 1
        if model is not None:
            if selects(self.model):
                self.turns = self.turns.after(adapter_set(model), self.options.num_parallel)
            member = self.members.get(model.name)
            if member is None:
                member = self.members[model.name] = Member(model, keep_alive)
            member.leases += 1
            member.keep_alive = keep_alive
            member.last_used = now
            member.turn = self.served

    def member_released(self, name: str, now: float) -> None:
        """A lease of model ``name`` ended (at ``now``): its keep-alive counts from now."""
        member = self.members.get(name)
        if member is not None and member.leases > 0:
            member.leases -= 1
            member.last_used = now

    def warm_members(self, now: float) -> list[Member]:
        """The models it serves that are warm at ``now`` (leased, or within their keep-alive),
        most recently used first."""
        return sorted((m for m in self.members.values() if m.expires > now), key=lambda m: (-m.last_used, -m.turn))

    def stays_for(self, now: float) -> float:
        """Seconds it stays once idle: its keep-alive, or with several models served the longest
        that any of them is still warm for (a model asked with keep-alive 0 leaves the group
        warm for the others)."""
        if len(self.members) <= 1 or not selects(self.model):
            return self.keep_alive
        return max(0.0, max(m.expires for m in self.members.values()) - now)

    def waiting_for_answer(self) -> None:
        """A request was sent and waits for its answer's first byte (undone by ``answered``)."""
        self.awaiting += 1
        if self.watch is not None and (check := trio.current_time() + self.answer_check) < self.watch.deadline:
            self.watch.deadline = check

    def answered(self) -> None:
        self.awaiting -= 1

    @property
    def exited(self) -> bool:
        """Its child has exited (seen by the child's own waiter, perhaps not yet by its lifetime
        task): it takes no lease, whatever its state says."""
        return self.handle is not None and self.handle.exited

    def leave(self, reason: str) -> None:
        """Take no new lease (its leases may end): it goes once they have (``Runners.released``)."""
        if not self.evicting:
            self.evicting = True
            self.unload_reason = reason

    def usage(self) -> tuple[tuple[str, int], ...]:
        """Bytes per device: what llama.cpp reported on each, or (a declared inventory, whose
        children run on the CPU) the placement's prediction scaled to its measured total; the
        prediction until measured (final once measured, so kept: every planning pass asks for
        every runner's usage)."""
        if self._usage is not None:
            return self._usage
        usage = views.usage_of(self.placement)
        measured = self.handle.measured if self.handle is not None else None
        # llama-server's prompt cache (--cache-ram) is a limit it grows into, in system memory,
        # absent from the buffers it reports: kept as predicted, outside the measured sizes.
        prompt_cache = max(0, self.options.cache_ram_mib) * 1024 * 1024
        predicted = self.placement.total - prompt_cache
        if measured is not None and measured.total > 0:
            exact = views.measured_usage(self.placement, measured, device_names(self.placement.devices))
            if exact is not None:
                per_device = dict(exact)
                per_device[views.CPU_ID] = per_device.get(views.CPU_ID, 0) + prompt_cache
                self._usage = tuple(sorted((d, b) for d, b in per_device.items() if b))
                return self._usage
        if measured is not None and measured.total > 0 and predicted > 0:
            scale = measured.total / predicted
            usage = tuple(
                (dev, int((b - prompt_cache) * scale) + prompt_cache if dev == views.CPU_ID else int(b * scale))
                for dev, b in usage
            )
            self._usage = usage
        return usage

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called, or the keep-alive expired (as its scopes' ``cancel_called``,
        without reading the clock while the runner is leased: asked several times a request)."""
        deadline = self.timer.deadline
        return self.stop_called or (deadline != math.inf and trio.current_time() >= deadline)

    @property
    def free_slot(self) -> bool:
        """Ready, staying, its child alive, and with a slot free: it can take a lease now."""
        return (
            self.state is RunnerState.READY
            and not self.evicting
            and not self.stopping
            and not self.exited
            and self.leases < self.options.num_parallel
        )

    def stop(self, reason: str) -> None:
        """Unload: cancel the serving phase (or the load itself, if still loading)."""
        self.stop_called = True
        self.timer.cancel(reason=reason)
        if self.state is RunnerState.LOADING:
            self.scope.cancel(reason=reason)

    def view(self) -> views.RunnerView:
        exited = self.exited
        state = RunnerState.UNLOADING if self.stopping or exited else self.state
        return views.RunnerView(
            id=self.id,
            model=self.model,
            options=self.options,
            state=state,
            leases=self.leases,
            evicting=self.evicting,
            keep_alive=self.keep_alive,
            last_used=self.last_used,
            usage=self.usage(),
            pinned=self.pinned,
            came_back=self.came_back,
            exited=exited,
            turns=self.turns if selects(self.model) else None,
            demand=self.meter.demand(trio.current_time()) if selects(self.model) else (),
            load_seconds=self.load_duration,
            own=self.own,
        )
