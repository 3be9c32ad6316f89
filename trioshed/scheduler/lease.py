"""A request's hold on a runner slot: what the HTTP edge gets from the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import RunnerCrashed
from trioshed.scheduler.runner import Runner

if TYPE_CHECKING:
    from trioshed.scheduler.scheduler import Scheduler


class Lease:
    """A request's hold on a runner slot, from dispatch until released (synchronous, idempotent)."""

    def __init__(self, scheduler: Scheduler, runner: Runner, load_duration: float, tenant: str = "") -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._tenant = tenant  # the API key's name: its slot is counted until released
        self.load_duration = load_duration
        self.released = False

    @property
    def model(self) -> ModelSpec:
        return self._runner.model

    @property
    def options(self) -> RunnerOptions:
        return self._runner.options

    @property
    def handle(self) -> Any:
        return self._runner.handle

    @property
    def base_url(self) -> str:
        return str(self._runner.handle.base_url)

    @property
    def crash(self) -> RunnerCrashed | None:
        """Set when the runner died under this lease: the error to give the client."""
        return self._runner.crash

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The RPC servers the runner uses (its crash is reported once they are checked)."""
        return self._runner.placement.endpoints

    def evict(self, reason: str) -> None:
        """The runner misbehaved under this lease (hung): replace it once its leases end."""
        self._scheduler.evict_after_leases(self._runner, reason)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._scheduler._release(self._runner, self._tenant)
