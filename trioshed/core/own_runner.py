"""When a hot adapter set of a group gets a runner of its own (pure).

An adapter group's runner serves every model of its group (:mod:`trioshed.core.adapters`), and
llama-server runs requests of different adapter sets in turns: while one set runs, the others
wait for the next decode step. A set whose requests keep the runner's slots full all the time,
beside other sets that have requests too, would run faster on a runner of its own (the base and
its adapters only), where nothing interleaves with it; the group's runner goes on serving the
others. That costs a load and a second copy of the base in memory, so the rule asks for:

- **sustained demand**: over the last :data:`WINDOW` seconds, the set had at least the runner's
  slot count of requests running or waiting for at least :data:`SUSTAINED` of the time (it
  alone would fill a runner), and another set had requests too (else nothing interleaves);
- **a gain above the load**: the time the set lost to the other sets' turns over the window
  (its share of the runner's steps given to others, at the measured price of a step that does
  not batch its requests: ``1 - price``, where ``price`` is the throughput of two requests of
  different sets over two of one set, :data:`ALTERNATION_PRICE`, ``bench.adapters --price``)
  is more than the runner's measured load time, so the runner pays for itself within a window;
- **room**: it fits beside the runners loaded now, without evicting any (the caller's
  placement says so).

Pure: no I/O, no clock; each group's runner keeps its :class:`DemandMeter`, fed by the planner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trioshed.core.adapter_turns import AdapterSet

__all__ = ["ALTERNATION_PRICE", "SUSTAINED", "WINDOW", "DemandMeter", "SetDemand", "own_runner"]

#: Seconds of demand the rule looks back over.
WINDOW = 60.0
#: The share of the window a set must have filled the runner's slots.
SUSTAINED = 0.8
#: Two requests at once of different adapter sets on one runner, over two of the same set
#: (tokens/s, measured by ``python -m bench.adapters``: 0.65 with Gemma 3 270M on a 2-core
#: CPU, one thread per runner; a device where a batch of two costs little more than one pays
#: more, not measured here: measure it there and pass ``price``).
ALTERNATION_PRICE = 0.65


@dataclass(frozen=True)
class SetDemand:
    """One adapter set's demand on a group's runner over the window: the seconds it had at
    least the runner's slot count of requests running or waiting (``full``), and the share of
    the runner's slot-seconds its requests held (``share``, 0 to 1)."""

    adapters: AdapterSet
    full: float
    share: float


def own_runner(
    demand: Sequence[SetDemand], *, fits: bool, load_seconds: float, price: float = ALTERNATION_PRICE, window: float = WINDOW
) -> AdapterSet | None:
    """The adapter set that gets a runner of its own now, or None (see the module docstring).

    ``fits``: a runner of the set fits beside the runners loaded now; ``load_seconds``: what a
    load of the group's base took (its runner's measured load time)."""
    if not fits or window <= 0:
        return None
    active = [d for d in demand if d.share > 0]
    if len(active) < 2:
        return None  # nothing interleaves with it
    hot = max(active, key=lambda d: (d.full, d.share))
    if hot.full < SUSTAINED * window:
        return None
    others = sum(d.share for d in active if d is not hot)
    lost = window * min(others, 1.0) * (1.0 - price)
    return hot.adapters if lost > load_seconds else None


class DemandMeter:
    """A group runner's demand per adapter set, over about the last ``window`` seconds: each
    set's seconds with at least ``slots`` requests running or waiting, and its share of the
    slot-seconds, as exponentially decaying integrals (time constant ``window``: a set that
    always fills the slots reads ``window`` seconds full). Fed at each change with the counts
    that held since the last one; ``now`` is given, never read."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._at: float | None = None
        self._counts: dict[AdapterSet, tuple[int, int]] = {}  # set -> (running, waiting) since _at
        self._slots = 1
        self._full: dict[AdapterSet, float] = {}
        self._held: dict[AdapterSet, float] = {}

    def update(self, now: float, counts: Mapping[AdapterSet, tuple[int, int]], slots: int) -> None:
        """The counts (running, waiting per set) from ``now`` on; what held before is counted."""
        self._advance(now)
        self._counts = {k: v for k, v in counts.items() if v != (0, 0)}
        self._slots = max(1, slots)

    def _advance(self, now: float) -> None:
        if self._at is not None and now > self._at:
            dt = now - self._at
            keep = math.exp(-dt / self.window)
            gained = self.window * (1.0 - keep)  # the decayed integral of 1 over dt
            for table in (self._full, self._held):
                for k in list(table):
                    table[k] *= keep
                    if table[k] < 1e-6:
                        del table[k]
            for k, (running, waiting) in self._counts.items():
                if running + waiting >= self._slots:
                    self._full[k] = self._full.get(k, 0.0) + gained
                if running:
                    self._held[k] = self._held.get(k, 0.0) + gained * min(running, self._slots) / self._slots
        if self._at is None or now > self._at:
            self._at = now

    def demand(self, now: float) -> tuple[SetDemand, ...]:
        """Each set's demand up to ``now``, in :class:`SetDemand`'s terms."""
        self._advance(now)
        sets = set(self._full) | set(self._held)
        return tuple(
            SetDemand(k, self._full.get(k, 0.0), self._held.get(k, 0.0) / self.window)
            for k in sorted(sets)
        )
