"""Count-then-fit in the scheduler: a request's prompt counted and fitted while it is leased.

A request that may have to be counted (:mod:`trioshed.core.fit` decides when and what follows)
comes to :meth:`Scheduler.acquire <trioshed.scheduler.Scheduler.acquire>` with a
:class:`PromptFit`: its size and a count function from the HTTP edge, which knows how to count
its protocol's prompt (``/apply-template`` and ``/tokenize``). The scheduler calls it on the
runner that is to count (:class:`CountOn`), and acts on the count: leases at the size found,
refuses, or grows the runner.

Counting is no request of its own: it takes no slot and no lease, so it never sets a runner's
keep-alive (a ``keep_alive: 0`` request is not unloaded by its own count and loaded again), nor
its statistics (``served``, ``came_back``), nor the request's trace (its queue and load waits
are its lease's); the request queues once. The runner is watched while it counts as while a
request waits for its answer (``Runner.waiting_for_answer``: a hung one is killed within
seconds). A count that llama-server refuses is no count: the request is leased by its bound,
and llama-server checks its prompt (its own error is translated the same way). A runner that
dies or stalls under the count on a lease is a runner failure like any other before the answer:
the request runs again on a new runner (:meth:`Lease.rerun`) before the lease is returned, so
that a wait that fails then (a load that fails, shutdown, a 507) is raised here, and the route
answers with that error and its status rather than a 200 that ends in an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from trioshed.core import fit
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import RunnerError, RunnerStalled, UpstreamError
from trioshed.runner.client import ConnectionFailed
from trioshed.scheduler.contracts import CountOn, PromptFit
from trioshed.scheduler.lease import Lease
from trioshed.scheduler.runner import Runner


async def fitted_lease(
    prompt: PromptFit,
    model: ModelSpec,
    options: RunnerOptions,
    loaded: Runner | None,
    lease: Callable[[RunnerOptions, int], Awaitable[Lease]],
) -> Lease:
    """A lease for a request of ``model`` with ``options`` fitted to ``prompt``: counted first
    on ``loaded`` (the model's ready runner, if any) where its automatic size would reload it
    larger, then leased (``lease(options, floor)``), and counted on its lease where its bound
    is more than the slot holds. Raises ContextTooLong or ContextOutOfMemory (the lease given
    back) where the prompt does not fit, and what leasing raises.

    Cancellation: as leasing; a lease held is given back."""
    sizing = fit.uncounted(options, prompt.need, prompt.automatic)
    on_loaded = fit.count_first(loaded.view() if loaded is not None else None, model, options, prompt.automatic)
    if on_loaded is not None and loaded is not None and loaded.handle is not None and not loaded.exited:
        loaded.waiting_for_answer()  # watched as a request is: a hung runner is found in seconds
        try:
            tokens = await _count(prompt, CountOn(loaded.model, loaded.options, loaded.handle.upstream))
        except (ConnectionFailed, RunnerStalled):
            tokens = None  # it died or hangs: no count here (the lease goes to another runner)
        finally:
            loaded.answered()
        if tokens is not None:
            sizing = fit.sized_by_count(tokens, options, on_loaded, prompt.output)
    held = await lease(sizing.options, sizing.floor)
    try:
        while fit.must_count(sizing.need, limit := fit.within(held.options, sizing.options, prompt.automatic)):
            failure: RunnerError | None = None
            with held.waiting_for_answer():
                try:
                    tokens = await _count(prompt, CountOn(held.model, held.options, held.handle.upstream))
                except RunnerStalled as exc:
                    held.evict("stalled: no output within TRIOSHED_STREAM_IDLE_TIMEOUT")
                    failure = exc
                except ConnectionFailed:
                    tokens = None
                    failure = await held.death()  # None: it lives on
            if failure is not None:
                # Its runner died or stalled before any answer: the request runs again on a new
                # one, now, before the route answers, so that a failed wait (a load that fails,
                # shutdown, a 507) is the route's own error, with its status.
                await held.rerun(failure)
                continue  # count again, on the new runner
            if tokens is not None and (num_ctx := fit.regrow_to(tokens, limit, held.shrunk, prompt.output, held.model)):
                await held.regrow(num_ctx)
            break
    except BaseException:
        held.release()
        raise
    return held


async def _count(prompt: PromptFit, on: CountOn) -> int | None:
    """The prompt's tokens counted on ``on`` (None: not counted). A refusal from llama-server
    (UpstreamError) is no count; ContextTooLong, shutdown and the runner's own failures
    (ConnectionFailed, RunnerStalled) are raised."""
    try:
        return await prompt.count(on)
    except UpstreamError:
        return None
