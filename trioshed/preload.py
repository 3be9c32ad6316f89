"""Preloading: models marked ``preload = true`` in models.toml are loaded at start-up.

``serve()`` awaits :func:`preload_models` after the scheduler starts and before it listens, so the
first request finds them loaded (and ``/api/ps`` lists them). Each preload is an ordinary
request without a client, with the options a plain request for that model would get (so that
the first real request reuses the runner); they are submitted together and the planner orders
them (priority, then file order). A preload that fails is logged; the server still starts.
"""

from __future__ import annotations

import logging

import trio

from trioshed.api.protocols.options import split_options
from trioshed.api.state import AppState
from trioshed.errors import TrioshedError

log = logging.getLogger(__name__)


async def preload_models(state: AppState) -> None:
    """Load every preload model of the store's catalogue; returns once each loaded or failed."""
    names = [entry.name for entry in state.store.catalogue().preload]
    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(preload_one, state, name, name=f"preload {name}")
            await trio.lowlevel.checkpoint()  # submitted in file order


async def preload_one(state: AppState, name: str) -> bool:
    """Load ``name`` with its default options and keep-alive; log the outcome."""
    started = trio.current_time()
    try:
        spec = state.store.resolve(name)
        _, runner_overrides = split_options(dict(spec.defaults))
        options = state.runner_options(spec, runner_overrides)
        async with state.scheduler.acquire(spec, options, None):
            pass
    except TrioshedError as exc:
        log.error("preload of %s failed (the server starts without it): %s", name, exc.message)
        return False
    log.info("preloaded %s in %.1fs", name, trio.current_time() - started)
    return True
