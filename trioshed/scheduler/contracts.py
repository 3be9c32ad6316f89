"""What the HTTP edge and the scheduler see of a running child, of a lease and of each other.

Public, typed Protocols, so that each side reads the other through attributes that are always
there, never by probing (``getattr(handle, "kill", None)``): the real classes and the test
fakes implement them fully, and mypy checks that they do.

- :class:`RunnerHandle`: a running child, as the scheduler and the edge use it (real:
  :class:`trioshed.runner.process.LlamaServer`; in-process: :class:`trioshed.testing.fake.FakeRunner`);
  its :class:`Upstream` is the connection pool every request to it goes through.
- :class:`LeaseView`: what a route may use of a lease (real: :class:`trioshed.scheduler.lease.Lease`).
- :class:`SchedulerView`: what the edge asks the scheduler for: a lease on a runner.

What a lease needs of the scheduler that granted it is :class:`trioshed.scheduler.lease.LeaseOwner`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from trioshed.core.context import Shrunk
from trioshed.core.model import MeasuredMemory, ModelSpec, RunnerOptions
from trioshed.errors import RunnerCrashed, RunnerError
from trioshed.keys import ApiKey
from trioshed.runner.slots import RunnerSlots


class UpstreamAnswer(Protocol):
    """A runner's answer whose head was read; its body is read with ``batches`` or ``read``."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def complete(self) -> bool:
        """Whether the body was read to its end."""
        ...
    def batches(self) -> AsyncGenerator[bytes, None]: ...
    async def read(self) -> bytes: ...
    def abort(self) -> None:
        """Close the connection now: a read under way, and every later one, fails."""
        ...


class Upstream(Protocol):
    """A runner's connection pool (real: :class:`trioshed.runner.client.UpstreamPool`).

    ``request`` raises :class:`trioshed.runner.client.ConnectionFailed` when no answer could be
    had (the child died, or was never there)."""

    def request(
        self, method: str, path: str, body: bytes = b"", *, content_type: str = "application/json"
    ) -> AbstractAsyncContextManager[UpstreamAnswer]: ...
    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``request("POST", …)`` read whole: its status and body."""
        ...

    async def get(self, path: str) -> tuple[int, bytes]:
        """``request("GET", …)`` read whole: its status and body."""
        ...


@dataclass(frozen=True)
class CountOn:
    """The runner a prompt is counted on: its model, options, and connection pool."""

    model: ModelSpec
    options: RunnerOptions
    upstream: Upstream


#: Counts a request's prompt on a runner: its tokens, or None where it cannot be counted (a
#: shape not counted, e.g. media). An UpstreamError (llama-server refused the count) is a
#: failed count, as None; ContextTooLong refuses the request; the runner's own failures
#: (:class:`~trioshed.runner.client.ConnectionFailed`, RunnerStalled) and ShuttingDown are
#: raised as they are, for the scheduler to act on.
Count = Callable[[CountOn], Awaitable["int | None"]]


@dataclass(frozen=True)
class PromptFit:
    """How a request's prompt is fitted to a runner's context."""

    need: int  # at most how many tokens it takes, prompt and output (its bound)
    output: int  # its output budget (0: not said)
    automatic: bool  # whether its num_ctx is automatic (set by neither settings, models.toml nor it)
    count: Count


class ChildOutput(Protocol):
    """The last lines a child printed."""

    def errors(self, lines: int = 6) -> str:
        """The lines most likely to explain a failure."""
        ...


class RunnerHandle(Protocol):
    """A running child: its address and connection pool, its output, its exit, and what it
    measured and counted."""

    @property
    def base_url(self) -> str: ...
    @property
    def upstream(self) -> Upstream: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def exited(self) -> bool: ...
    @property
    def measured(self) -> MeasuredMemory | None:
        """The memory llama.cpp reported (None until it did, or never for a fake)."""
        ...
    @property
    def speculation(self) -> tuple[int, int]:
        """Speculative decoding so far: (tokens drafted, tokens accepted)."""
        ...
    @property
    def slots(self) -> RunnerSlots | None:
        """Warm returns: its saved slots (None: off)."""
        ...
    @property
    def tail(self) -> ChildOutput: ...
    async def wait_exited(self) -> int | None: ...
    async def health(self) -> bool:
        """Whether it answers its health check now."""
        ...
    def kill(self) -> None:
        """Kill it now (SIGKILL: a hung child may not act on SIGTERM)."""
        ...


class LeaseView(Protocol):
    """What a route may use of its lease on a runner slot (see :mod:`trioshed.scheduler.lease`)."""

    @property
    def model(self) -> ModelSpec:
        """The runner's model (an adapter group's runner: the base with the group's adapters)."""
        ...
    @property
    def options(self) -> RunnerOptions: ...
    @property
    def lora(self) -> list[dict[str, object]] | None:
        """The ``lora`` list that selects the request's adapters on this runner (every adapter
        it loaded, by id, at the request's scale, 0 for the others); None: it loaded none."""
        ...
    @property
    def handle(self) -> RunnerHandle: ...
    @property
    def load_duration(self) -> float: ...
    @property
    def crash(self) -> RunnerCrashed | None:
        """Set when the runner died under this lease: the error to give the client."""
        ...
    async def death(self) -> RunnerCrashed | None:
        """After the connection to the runner broke: its crash once the scheduler recorded it, if
        its child died (an event, never a poll); None if the child lives on."""
        ...
    def produced(self) -> None:
        """The runner sent a piece of an answer (a sign of life for its health monitor)."""
        ...
    @property
    def shrunk(self) -> Shrunk | None:
        """Where the request's automatic context was made smaller to fit, and why."""
        ...
    @property
    def rerun_after(self) -> RunnerError | None:
        """The death or stall that made this request run again on a new runner (None: it has not)."""
        ...
    @property
    def released(self) -> bool: ...
    def evict(self, reason: str) -> None: ...
    def waiting_for_answer(self) -> AbstractContextManager[None]: ...
    async def rerun(self, crash: RunnerError) -> None: ...
    async def regrow(self, num_ctx: int) -> None: ...
    def release(self) -> None: ...


L_co = TypeVar("L_co", bound=LeaseView, covariant=True)


class SchedulerView(Protocol[L_co]):
    """What the edge asks the scheduler for: a lease on a runner of ``model`` with ``options``
    (real: :class:`trioshed.scheduler.Scheduler`, whose leases are :class:`~trioshed.scheduler.Lease`)."""

    def acquire(
        self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None = None, *,
        key: ApiKey = ..., floor: int = 0, fit: PromptFit | None = None,
    ) -> AbstractAsyncContextManager[L_co]: ...
    async def wait_for_lease(
        self, model: ModelSpec, options: RunnerOptions, keep_alive: float | None, *,
        key: ApiKey = ..., floor: int = 0, fit: PromptFit | None = None,
    ) -> L_co: ...
