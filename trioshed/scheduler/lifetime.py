"""The runners the scheduler owns: what it does to them, and each one's life (load, serve, watch,
unload, clean up).

One task per runner (started in the scheduler's nursery by :meth:`Runners.start`) wraps the child
in the runner's cancel scopes: unloading is cancelling ``timer`` (its deadline is the keep-alive
expiry), aborting a load is cancelling ``scope``. An unexpected exit of the child is seen at once
by the same task; a live but hung child by the health check. Around the edges: which RPC servers
a failed or crashed runner lost (checked, bounded, before it is reported), the load-failure
back-off, and waiting for the GPUs' free memory to come back after an unload.

:class:`Runners` is owned by the scheduler, which reads it as a mapping (a runner is in it from
its start until its life ends) and tells it what to do: start a runner, evict or unload one, pin a
model for the session, ping a runner before it is reused, let a released one's keep-alive run. A
life tells the scheduler what happened only through the few callbacks it was given
(:class:`Owner`): no attribute of the scheduler is read or written here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from trioshed.core import admission
from trioshed.core.adapters import adapter_set, runner_model, selects
from trioshed.core.model import MemoryEstimate, ModelSpec, Placement, RunnerOptions
from trioshed.core.views import CPU_ID, RunnerState, same_files
from trioshed.devices import DeviceSource
from trioshed.devices.rpc import RemoteDevices
from trioshed.errors import LoadFailed, RunnerCrashed, TrioshedError
from trioshed.scheduler.runner import Runner, RunnerFactory

log = logging.getLogger(__name__)

COOLDOWN_FIRST = 10.0
COOLDOWN_MAX = 300.0
VRAM_RECOVERY_TIMEOUT = 5.0
VRAM_POLL_INTERVAL = 0.25
HEALTH_INTERVAL = 15.0
HEALTH_TIMEOUT = 10.0  # the reference's ping timeout
#: A runner idle this long (seconds) is pinged before it is handed a request ...
PING_IDLE = 1.0
#: ... and killed as hung when it does not answer within this many seconds (the request then
#: waits for its replacement): a request reaches a runner that answers, or gets an error, within
#: a few seconds of the runner hanging (a stopped llama-server otherwise held it until the
#: health monitor's two failures, and then nothing answered it at all).
PING_TIMEOUT = 3.0
PING_RETRIES = 2  # runners in a row that may fail their ping before a request takes one as it is
REMOTE_CHECK_TIMEOUT = 3.0  # how long a crashed runner's RPC servers are checked before it is reported


def _killed(exc: LoadFailed) -> bool:
    """Whether the child died of a signal (a negative exit code), not by its own exit."""
    return exc.returncode is not None and exc.returncode < 0


def _twice(exc: LoadFailed, model: str) -> LoadFailed:
    """The error for a second load in a row whose child was killed (the first was retried)."""
    return LoadFailed(
        f"llama-server for model '{model}' was killed (code {exc.returncode}) while loading, twice in a "
        "row; if the machine is short of memory, the kernel's out-of-memory killer may be the cause "
        "(its log: dmesg)",
        returncode=exc.returncode,
        stderr_tail=exc.stderr_tail,
    )


async def _alive(runner: Runner, handle: Any, within: float) -> bool:
    """One health check: whether ``runner`` answers ``/health`` within ``within`` seconds, or
    sends output meanwhile (its leases relay tokens: alive however slow its ``/health``)."""
    before = runner.progress
    with trio.move_on_after(within):
        if await handle.health():
            return True
    return runner.progress != before


class Note(Protocol):
    """The scheduler's record of an event: logged, kept for tests, and in the event history."""

    def __call__(self, event: str, model: ModelSpec, reason: str = "", seconds: float = 0.0) -> None: ...


@dataclass(frozen=True)
class Owner:
    """What a runner's life tells the scheduler that owns it, and nothing more."""

    #: an event to log, record and keep in the history ("ready", "crashed", "load failed"...)
    note: Note
    #: a change the planner must look at (a runner ready, gone, hung)
    wake: Callable[[], None]
    #: a load ran out of memory: whether its waiters are tried at smaller contexts instead
    #: (then no back-off, and none of them fails with the load's error)
    out_of_memory: Callable[[Runner, LoadFailed], bool]
    #: a load failed: the requests waiting for it fail with ``error``
    fail_waiters: Callable[[Runner, TrioshedError], None]


class Runners(Mapping[int, Runner]):
    """The scheduler's runners by id, each with its life task; the load-failure back-off."""

    def __init__(self, owner: Owner, *, factory: RunnerFactory, devices: DeviceSource, remote: RemoteDevices | None) -> None:
        self._owner = owner
        self._factory = factory
        self._devices = devices
        self._remote = remote
        self._runners: dict[int, Runner] = {}
        #: model path -> (until, cause): a model whose load failed is not loaded again until then
        self.cooldowns: dict[str, tuple[float, str]] = {}
        self._backoff: dict[str, float] = {}
        self._killed_loading: set[str] = set()  # model paths whose last load's child was killed by a signal
        self._session_pins: dict[str, bool] = {}  # model path -> pinned, set by pin() until restart
        self.counters = dict(loads=0, unloads=0, crashes=0, load_failures=0)

    # -- the mapping the scheduler reads (dict speed: the fast path asks on every request) ---------

    def __getitem__(self, runner_id: int) -> Runner:
        return self._runners[runner_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._runners)

    def __len__(self) -> int:
        return len(self._runners)

    def __contains__(self, runner_id: object) -> bool:
        return runner_id in self._runners

    def values(self) -> ValuesView[Runner]:
        return self._runners.values()

    def any_closed(self) -> bool:
        """Whether the planner closed a runner to later requests (``Runner.closed_from``)."""
        return any(r.closed_from != math.inf for r in self._runners.values())

    # -- what the scheduler does to its runners --------------------------------------------------

    def start(
        self, runner_id: int, model: ModelSpec, options: RunnerOptions, placement: Placement, estimate: MemoryEstimate,
        *, keep_alive: float, runner_nursery: trio.Nursery, runner: ModelSpec | None = None,
    ) -> Runner:  # fmt: skip
        """A new runner for ``model`` (with ``options``): loaded, then served, in a task of
        ``runner_nursery`` (the scheduler's). An adapter-model's runner loads its whole group
        (:func:`trioshed.core.adapters.runner_model`), and serves every member; ``runner``: the
        runner's own spec where the plan chose another (one model's adapters only)."""
        now = trio.current_time()
        spec = runner if runner is not None else runner_model(model, embedding=options.embedding)
        started = Runner(
            runner_id, spec, options, placement, estimate, keep_alive=keep_alive,
            pinned=self._session_pins.get(spec.path, spec.pinned), last_used=now, load_started=now, own=runner is not None,
        )  # fmt: skip
        self._runners[started.id] = started
        self.counters["loads"] += 1
        self._owner.note("load", started.model)
        runner_nursery.start_soon(self._life, started, name=f"runner {started.model.name}")
        return started

    def evict(self, runner: Runner, reason: str) -> None:
        """Take ``runner`` out of service (``reason``): no new lease; unloaded once its leases
        end (now, if it has none)."""
        runner.evicting = True
        runner.unload_reason = reason
        self._owner.note("evict", runner.model, reason)
        if runner.leases == 0:
            runner.stop(reason)

    def evict_after_leases(self, runner: Runner, reason: str) -> None:
        """Replace ``runner`` once its leases end (it misbehaved under one: hung)."""
        if not runner.evicting:
            runner.evicting = True
            runner.unload_reason = reason
            self._owner.note("evict", runner.model, reason)
            self._owner.wake()

    def unload(self, model: ModelSpec) -> list[Runner]:
        """Unload every runner of ``model``'s file (one with leases once they end); returns them.
        An adapter group's runner that other models of its group keep warm stays: ``model`` (one
        of its models, not the runner's own spec) is no longer one of its warm models."""
        now = trio.current_time()
        runners = []
        for r in self._runners.values():
            if r.model.path != model.path:
                continue
            if model != r.model and selects(r.model) and any(adapter_set(m.model) != adapter_set(model) for m in r.warm_members(now)):
                r.members.pop(model.name, None)
                continue
            runners.append(r)
        for r in runners:
            r.evicting = True
            r.unload_reason = "unload requested"
            if r.leases == 0:
                r.stop("unload requested")
        self._owner.wake()
        return runners

    def pin(self, model: ModelSpec, pinned: bool, default_keep_alive: float) -> list[Runner]:
        """Pin or unpin ``model``'s file until restart, and its runners that stay, with the
        keep-alive that gives (counted from now where idle); returns those runners."""
        self._session_pins[model.path] = pinned
        runners = [r for r in self._runners.values() if r.model.path == model.path and not r.stopping]
        for r in runners:
            r.pinned = pinned
            r.keep_alive = admission.keep_alive(None, self.pinned_for_session(r.model), default_keep_alive)
            if r.leases == 0 and r.state is RunnerState.READY:
                r.timer.deadline = trio.current_time() + r.keep_alive
        self._owner.wake()
        return runners

    def pinned_for_session(self, model: ModelSpec) -> ModelSpec:
        """``model`` as pin() left it: pinned (keep-alive forever unless set), or unpinned."""
        return admission.pinned_for_session(model, self._session_pins.get(model.path))

    def released(self, runner: Runner) -> None:
        """A lease on ``runner`` ended and no waiter took its slot: with no lease left, it is
        unloaded (being evicted, or keep-alive 0), or its keep-alive starts counting."""
        if runner.leases == 0 and runner.id in self._runners:
            now = trio.current_time()
            stays = runner.stays_for(now)
            if runner.evicting or runner.exited or stays <= 0:
                runner.stop(runner.unload_reason or "keep_alive 0")
            else:
                runner.timer.deadline = now + stays

    async def answers(self, runner: Runner) -> bool:
        """Ping ``runner`` before it is reused: whether it answers within PING_TIMEOUT, or sends
        output meanwhile (if neither, it is killed as hung)."""
        if runner.handle is not None and await _alive(runner, runner.handle, PING_TIMEOUT):
            return True
        self.declare_hung(runner, f"neither answered a health check nor sent output for {PING_TIMEOUT:g}s before reuse")
        return False

    def ready_runner(self, model: ModelSpec) -> Runner | None:
        """A ready runner of ``model``'s files, not leaving (None: none is up)."""
        for r in self._runners.values():
            if r.state is RunnerState.READY and not r.stopping and not r.evicting and not r.exited and same_files(r.model, model):
                return r
        return None

    def remote_busy(self) -> set[str]:
        """The RPC servers our runners hold (each serves one client: not to be probed)."""
        return {e for r in self._runners.values() for e in r.placement.endpoints}

    # -- a runner's life -----------------------------------------------------------------------

    async def _life(self, runner: Runner) -> None:
        """Load, serve until stopped (timer cancelled or keep-alive deadline) or crashed, clean up."""
        try:
            with runner.scope:
                try:
                    async with self._factory(runner.model, runner.options, runner.placement) as handle:
                        self._on_ready(runner, handle)
                        with runner.timer:
                            async with trio.open_nursery() as watchers:
                                watchers.start_soon(self._monitor_health, runner, handle)
                                await handle.wait_exited()
                                watchers.cancel_scope.cancel()
                        if handle.exited:
                            # It exited on its own (a stop reaches the child only as the factory's
                            # block ends, below), also when a stop came before this task saw the exit.
                            with trio.CancelScope(shield=True):  # bounded: REMOTE_CHECK_TIMEOUT
                                cause = runner.hung or await self._check_remote(runner)
                            self._on_crash(runner, cause)
                            return
                        # Stopped (unload, eviction, keep-alive expiry): the child is still alive here,
                        # so this is the moment to read the GPUs' free memory before it goes.
                        runner.state = RunnerState.UNLOADING
                        baseline = self._vram_baseline(runner)
                    self.counters["unloads"] += 1
                    expired = "keep_alive 0" if runner.keep_alive <= 0 else "keep_alive expired"
                    self._owner.note("unloaded", runner.model, runner.unload_reason or expired)
                    if baseline is not None:
                        await self._wait_for_vram_recovery(runner, baseline)
                except LoadFailed as exc:
                    with trio.CancelScope(shield=True):  # bounded: REMOTE_CHECK_TIMEOUT
                        lost = await self._lost_remote(runner)
                    if lost:
                        self._on_remote_load_lost(runner, lost)
                    elif _killed(exc) and runner.model.path not in self._killed_loading:
                        self._on_killed_loading(runner, exc)
                    else:
                        self._on_load_failed(runner, _twice(exc, runner.model.name) if _killed(exc) else exc)
                except (OSError, RuntimeError) as exc:
                    self._on_load_failed(runner, LoadFailed(f"cannot run llama-server: {exc}"))
        finally:
            self._runners.pop(runner.id, None)
            runner.gone.set()
            self._owner.wake()

    async def _monitor_health(self, runner: Runner, handle: Any) -> None:
        """Check the runner every HEALTH_INTERVAL, and every PING_TIMEOUT while a request waits
        for the first byte of its answer. A check fails when the runner neither answers
        ``/health`` nor sends output (``Runner.progress``) within its timeout (HEALTH_TIMEOUT;
        PING_TIMEOUT while a request waits); two failed checks in a row and it is hung (while a
        request waits, the second follows the first at once).

        The exit watcher sees a dead child at once; this catches a live but hung one between
        requests (a request pings a runner idle for PING_IDLE before using it), and one that
        stopped after that ping, with a request on it: killed, it is replaced and the request
        runs again (:meth:`Lease.rerun`). The streams on a hung runner end with an error. A
        runner busy streaming on a saturated CPU, whose ``/health`` is slow, is alive: the
        tokens it sends count.
        """
        failures = 0
        runner.answer_check = PING_TIMEOUT
        due = trio.current_time() + HEALTH_INTERVAL
        while not handle.exited:  # an exit is the exit watcher's (it may see it late): no check
            if not (failures and runner.awaiting):
                soon = trio.current_time() + PING_TIMEOUT
                runner.watch = trio.CancelScope(deadline=min(due, soon) if runner.awaiting else due)
                with runner.watch:
                    await trio.sleep_forever()
            waited = runner.awaiting > 0
            healthy = await _alive(runner, handle, PING_TIMEOUT if waited else HEALTH_TIMEOUT)
            due = trio.current_time() + HEALTH_INTERVAL
            if healthy or handle.exited:
                failures = 0
                continue
            failures += 1
            if failures < 2:
                continue
            if waited:
                why = f"neither answered two health checks of {PING_TIMEOUT:g}s in a row nor sent output while a request waited for its answer"
            else:
                why = f"neither answered two health checks {HEALTH_INTERVAL:g}s apart nor sent output"
            self.declare_hung(runner, why)
            return

    def declare_hung(self, runner: Runner, why: str) -> None:
        """A live runner that does not answer: kill it now (SIGKILL; a hung child may not act
        on SIGTERM), so that its streams end with an error naming ``why`` and its requests'
        model is loaded again. A runner without a child yet is unloaded once its leases end."""
        if runner.hung or runner.exited:  # an exited child is the exit watcher's, not hung
            return
        runner.hung = f"it stopped answering ({why}) and was killed"
        self._owner.note("unhealthy", runner.model, why)
        log.warning("llama-server for %s %s", runner.model.name, runner.hung)
        runner.evicting = True
        runner.unload_reason = "health check failed"
        if runner.handle is not None:
            runner.handle.kill()
        elif runner.leases == 0:
            runner.stop("health check failed")
        self._owner.wake()

    def _on_ready(self, runner: Runner, handle: Any) -> None:
        self._killed_loading.discard(runner.model.path)
        runner.handle = handle
        runner.state = RunnerState.READY
        runner.load_duration = trio.current_time() - runner.load_started
        self.cooldowns.pop(runner.model.path, None)
        self._backoff.pop(runner.model.path, None)
        self._owner.note("ready", runner.model, seconds=runner.load_duration)
        self._owner.wake()

    async def _lost_remote(self, runner: Runner) -> list[str]:
        """The RPC servers of ``runner`` that answer no more ("address (why)"), checked now."""
        if not runner.placement.endpoints or self._remote is None:
            return []
        with trio.move_on_after(REMOTE_CHECK_TIMEOUT):
            return await self._remote.check(runner.placement.endpoints)
        return []

    def _on_remote_load_lost(self, runner: Runner, lost: list[str]) -> None:
        """A load failed because an RPC server went away: no back-off for the model; its waiting
        requests stay queued and are placed again without that server."""
        self.counters["load_failures"] += 1
        log.warning("load of %s failed: RPC server %s stopped answering", runner.model.name, ", ".join(lost))
        self._owner.note("load failed", runner.model, f"RPC server {', '.join(lost)} stopped answering")
        self._runners.pop(runner.id, None)

    async def _check_remote(self, runner: Runner) -> str:
        """A runner on RPC servers exited: which of them stopped answering? (The cause to report.)

        The runner takes no new lease meanwhile, and its servers stay out of placement (its
        usage still holds them) until the check is done.
        """
        endpoints = runner.placement.endpoints
        if not endpoints or self._remote is None:
            return ""
        runner.state = RunnerState.UNLOADING
        self._owner.wake()
        lost: list[str] | None = None
        with trio.move_on_after(REMOTE_CHECK_TIMEOUT):
            lost = await self._remote.check(endpoints)
        if lost:
            return (
                f"its RPC server {', '.join(lost)} stopped answering; it is left out of placement "
                "until it answers again"
            )
        return f"it ran on the RPC servers {', '.join(endpoints)}" + (
            ", which still answer" if lost is not None else ""
        )

    def _on_crash(self, runner: Runner, cause: str = "") -> None:
        """The child exited on its own: forget the runner now, so the next request reloads."""
        self.counters["crashes"] += 1
        handle = runner.handle
        runner.crash = RunnerCrashed(
            runner.model.name,
            handle.returncode if handle is not None else None,
            handle.tail.errors() if handle is not None else "",
            cause,
        )
        runner.state = RunnerState.UNLOADING
        self._runners.pop(runner.id, None)
        runner.gone.set()  # its leases' requests may run again now (Lease.death)
        self._owner.note("crashed", runner.model, runner.crash.message[:300])
        self._owner.wake()

    def _on_killed_loading(self, runner: Runner, exc: LoadFailed) -> None:
        """The child died of a signal while loading (SIGKILL from outside, the OOM killer): not
        the model's fault as far as anyone knows, so no back-off, and its waiting requests stay
        queued for the load that starts at once. A second such death in a row is a failure."""
        self.counters["load_failures"] += 1
        self._killed_loading.add(runner.model.path)
        log.warning("llama-server for %s was killed (code %s) while loading; loading it again", runner.model.name, exc.returncode)
        self._owner.note("load failed", runner.model, f"killed (code {exc.returncode}) while loading; loading it again")
        self._runners.pop(runner.id, None)

    def _on_load_failed(self, runner: Runner, exc: LoadFailed) -> None:
        self.counters["load_failures"] += 1
        path = runner.model.path
        if self._owner.out_of_memory(runner, exc):  # out of memory: a smaller context, now (no cooldown)
            self._owner.note("load failed", runner.model, exc.message[:300])
            self._runners.pop(runner.id, None)
            return
        self._backoff[path] = min(self._backoff.get(path, COOLDOWN_FIRST / 2) * 2, COOLDOWN_MAX)
        self.cooldowns[path] = (trio.current_time() + self._backoff[path], exc.message[:300])
        self._owner.note("load failed", runner.model, exc.message[:300])
        self._runners.pop(runner.id, None)
        self._owner.fail_waiters(runner, exc)

    def _vram_baseline(self, runner: Runner) -> int | None:
        if not (runner.placement.devices and self._devices.recovers_vram):
            return None
        ids = set(runner.placement.devices)
        return sum(d.free for d in self._devices.poll() if d.id in ids)

    async def _wait_for_vram_recovery(self, runner: Runner, baseline: int) -> None:
        """Free GPU memory lags behind a child's exit: wait until ~80% of its use is back."""
        expected = sum(b for dev, b in runner.usage() if dev != CPU_ID)
        ids = set(runner.placement.devices)
        with trio.move_on_after(VRAM_RECOVERY_TIMEOUT) as scope:
            while True:
                # NVML's memory query takes microseconds: called inline, like the planner's
                if sum(d.free for d in self._devices.poll() if d.id in ids) - baseline >= 0.8 * expected:
                    break
                await trio.sleep(VRAM_POLL_INTERVAL)
        if scope.cancelled_caught:
            log.warning("GPU memory of %s did not recover within %.0fs", runner.model.name, VRAM_RECOVERY_TIMEOUT)
