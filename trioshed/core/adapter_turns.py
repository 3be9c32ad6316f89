"""Turns between the adapter sets of a group's runner: who gets its next free slot (pure).

An adapter group's runner serves several models (:mod:`trioshed.core.adapters`), and llama-server
does not batch requests with different adapter sets in one decode step: requests of one set run
together, several sets run in turns. So its waiting requests queue per adapter set, and the
sets take turns, round robin: a turn gives up to ``size`` slots (the runner's slot count: a full
batch) to one set, oldest request first; the next turn goes to the waiting set whose last turn
is the longest ago (a set never served first; between those, the one whose oldest request
waited longest). In arrival order instead, a model whose clients send a hundred requests at once
would hold every other model of its group behind all of them.

The bound: with ``k`` sets waiting, every other set has one turn before any set has a second, so
a request that is the oldest of its set takes a slot after at most ``size * k`` slots given to
other sets (the rest of the turn under way, then one turn of each other set), however many
requests those sets queue (tested under ``MockClock`` in ``tests/scheduler``). Within a set,
arrival order. Each tenant's fair share is decided before: turns only order the requests of one
runner's group among themselves.

Pure: no I/O, no clock; the runner keeps its :class:`Turns`
(:class:`trioshed.scheduler.runner.Runner`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

from trioshed.core.adapters import adapter_set
from trioshed.core.model import ModelSpec

__all__ = ["AdapterSet", "Turns", "by_turns", "in_turns", "set_of"]

#: An adapter set as :func:`trioshed.core.adapters.adapter_set` gives it (the base: empty).
AdapterSet = tuple[tuple[str, float], ...]
Q = TypeVar("Q")


@dataclass(frozen=True)
class Turns:
    """A runner's turns so far: the set whose turn is under way, the slots it has given, how
    many turns have begun, and when (by that count) each set's last turn began."""

    current: AdapterSet | None = None
    served: int = 0
    begun: int = 0
    last: Mapping[AdapterSet, int] = field(default_factory=lambda: MappingProxyType({}))

    def after(self, adapters: AdapterSet, size: int) -> Turns:
        """The turns once a request of ``adapters`` took a slot: the same turn one slot further
        while it has room, else a new turn of its set."""
        if adapters == self.current and self.served < max(1, size):
            return Turns(adapters, self.served + 1, self.begun, self.last)
        last = MappingProxyType({**self.last, adapters: self.begun})
        return Turns(adapters, 1, self.begun + 1, last)

    def next(self, candidates: Sequence[Q], set_of: Callable[[Q], AdapterSet], size: int) -> Q | None:
        """Which of ``candidates`` (the requests the runner can serve, oldest first) takes its
        next free slot: the oldest of the current set while its turn has room, else the oldest of
        the set whose last turn is the longest ago (see the module docstring)."""
        if not candidates:
            return None
        oldest: dict[AdapterSet, tuple[int, Q]] = {}
        for i, c in enumerate(candidates):
            oldest.setdefault(set_of(c), (i, c))  # each set's oldest request, and its place
        if self.current in oldest and self.served < max(1, size):
            return oldest[self.current][1]
        others = [s for s in oldest if s != self.current] or list(oldest)
        chosen = min(others, key=lambda s: (self.last.get(s, -1), oldest[s][0]))
        return oldest[chosen][1]


def in_turns(candidates: Sequence[Q], set_of: Callable[[Q], AdapterSet], turns: Turns, size: int) -> list[Q]:
    """``candidates`` (oldest first) in the order the runner would serve them, one slot after
    another, from the turns so far."""
    left = list(candidates)
    out: list[Q] = []
    while left:
        chosen = turns.next(left, set_of, size)
        assert chosen is not None
        left.remove(chosen)
        out.append(chosen)
        turns = turns.after(set_of(chosen), size)
    return out


class _Queued(Protocol):
    @property
    def model(self) -> ModelSpec: ...


class _Served(Protocol):
    @property
    def model(self) -> ModelSpec: ...
    @property
    def turns(self) -> Turns | None: ...
    @property
    def slots(self) -> int: ...


R = TypeVar("R", bound=_Queued)


def set_of(request: _Queued) -> AdapterSet:
    """The adapter set a request applies."""
    return adapter_set(request.model)


def by_turns(requests: Sequence[R], runners: Iterable[_Served]) -> list[R]:
    """``requests`` (in the planner's order) with those of each adapter group whose runner
    takes turns put in its turn order, in the places they held: the other models' requests,
    and which places a group's requests take, do not change."""
    runner_of: dict[str, _Served] = {}
    for r in runners:
        if r.turns is not None:
            runner_of.setdefault(r.model.path, r)
    if not runner_of:
        return list(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        if req.model.path in runner_of:
            groups.setdefault(req.model.path, []).append(i)
    out = list(requests)
    for path, places in groups.items():
        if len(places) < 2:
            continue
        runner = runner_of[path]
        assert runner.turns is not None
        ordered = in_turns([requests[i] for i in places], set_of, runner.turns, runner.slots)
        for i, req in zip(places, ordered, strict=True):
            out[i] = req
    return out
