"""A planning pass: the waiting requests and the runners put to the pure planner
(:func:`trioshed.core.sched.plan`), and what it returns performed: dispatch, load, evict, fail;
the requests it holds back for a swap timed, its waits for memory noted.

The scheduler (:mod:`.scheduler`) runs one pass per batch of changes and owns everything a pass
acts on; :class:`Planning` is handed those parts and the two acts that stay the scheduler's own
(a dispatch, a load begun), so that the pass reads top to bottom here. Not a yield anywhere: a
pass is one step of the scheduler's loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from trioshed.core import sched
from trioshed.core.model import ModelSpec, Placement
from trioshed.core.queue import Waiting
from trioshed.core.sched import Dispatch, Evict, Fail, Load, Machine
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import RemoteDevices
from trioshed.scheduler.adapter_demand import feed_demand
from trioshed.scheduler.lifetime import Runners
from trioshed.scheduler.queue import RequestQueue
from trioshed.scheduler.request import Request
from trioshed.scheduler.resize import Resizer
from trioshed.scheduler.runner import Runner

log = logging.getLogger("trioshed.scheduler.scheduler")  # the pass's lines, as the scheduler's


@dataclass(frozen=True)
class Limits:
    """What the planner is told of the machine beside its devices: fixed for a server's life."""

    max_loaded: int  # most runners at once (TRIOSHED_MAX_LOADED_MODELS, or its default)
    overhead: int  # bytes reserved per GPU (TRIOSHED_GPU_OVERHEAD)
    spread: bool  # every model over all GPUs (TRIOSHED_SCHED_SPREAD)
    max_extra_wait: float  # TRIOSHED_MAX_EXTRA_WAIT (0: arrival order)


class Planning:
    """One pass at a time over the scheduler's parts (see the module's docstring).

    ``hold_timer``'s deadline is when a request held back for a swap becomes due: the scheduler's
    timer task plans again then (nothing else may change meanwhile)."""

    def __init__(
        self,
        *,
        waiting: Waiting[Request],
        runners: Runners,
        devices: DeviceSource,
        remote: RemoteDevices | None,
        place: sched.Placer,
        limits: Limits,
        queue: RequestQueue,
        resizer: Resizer,
        dispatch: Callable[[Request, Runner], None],
        start_load: Callable[[Request, Placement, ModelSpec | None], Runner],
        record: list[tuple[str, str]] | None,
    ) -> None:
        self._waiting = waiting
        self._runners = runners
        self._devices = devices
        self._remote = remote
        self._place = place
        self.limits = limits
        self._queue = queue
        self._resizer = resizer
        self._dispatch = dispatch
        self._start_load = start_load
        self._record = record
        self.hold_timer = trio.CancelScope()  # its deadline: when a held request becomes due
        self.counters = dict(room_waits=0, passes=0)  # the runners and the queue count the rest

    def holding(self) -> bool:
        """A request is held back for a swap (a pass is due when it becomes due)."""
        return self.hold_timer.deadline != math.inf

    def machine(self) -> Machine:
        remote = self._remote
        return Machine(
            gpus=self._devices.poll() + (remote.devices() if remote is not None else ()),
            system=self._devices.system(),
            max_loaded=self.limits.max_loaded,
            overhead=self.limits.overhead,
            spread=self.limits.spread,
            remote_down=remote.down() if remote is not None else (),
        )

    def run(self) -> bool:
        """One pass; whether it began anything (a dispatch, a load, an eviction, a refusal)."""
        now = trio.current_time()
        if not self._waiting:
            self.hold_timer.deadline = math.inf
            for r in self._runners.values():
                r.closed_from = math.inf
            return False
        self.counters["passes"] += 1
        feed_demand(self._runners.values(), self._waiting, now)  # adapter groups: each set's demand
        requests = self._waiting.by_id.copy()
        actions = sched.plan(
            [r.view for r in self._waiting],
            [r.view() for r in self._runners.values()],
            self.machine(),
            place=self._place,
            now=now,
            cooldowns=self._runners.cooldowns,
            next_runner_id=-1,
            max_extra_wait=self.limits.max_extra_wait,
        )
        for rid in actions.held:
            requests[rid].held(now)
        for r in self._runners.values():
            r.closed_from = actions.closed.get(r.id, math.inf)
        self.hold_timer.deadline = actions.wake_at
        provisional: dict[int, Runner] = {}
        for action in actions:
            match action:
                case Dispatch(request=rid, runner=runner_id):
                    runner = self._runners.get(runner_id) or provisional[runner_id]
                    self._dispatch(requests[rid], runner)
                case Load(request=rid, placement=placement, model=model):
                    runner = self._start_load(requests[rid], placement, model)
                    provisional[-(len(provisional) + 1)] = runner
                case Evict(runner=runner_id, reason=reason):
                    self._runners.evict(self._runners[runner_id], reason)
                case Fail(request=rid, error=error):
                    if not self._resizer.after_refusal(requests[rid], error):  # tried smaller
                        self._queue.fail(requests[rid], error)
        for wait in actions.waits:
            self._note_room_wait(requests[wait.request], wait)
        return bool(actions)

    def _note_room_wait(self, req: Request, wait: sched.RoomWait) -> None:
        """Count a request's first wait for memory and log it with its numbers (INFO; a later
        change of reason at DEBUG: every pass re-decides, and the first says what matters)."""
        if wait.reason == req.room_wait:
            return
        first = not req.room_wait
        req.room_wait = wait.reason
        if first:
            self.counters["room_waits"] += 1
            if self._record is not None:
                self._record.append(("wait for room", req.model.short_name))
        log.log(logging.INFO if first else logging.DEBUG, "%s %s", req.model.name, wait.describe())

