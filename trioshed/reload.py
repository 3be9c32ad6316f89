"""SIGHUP: re-read ``models.toml`` and replace only the runners whose model changed.

A runner was started from a :class:`ModelSpec` (file, adapters, projector, options, flags...).
After the reload each runner's name is resolved again; a runner whose spec is unchanged keeps
serving untouched, one whose entry changed or disappeared is unloaded (once its requests end:
the scheduler's ``unload``) so that the next request starts it from the new entry.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace

import trio

from trioshed.api.state import AppState
from trioshed.core.adapters import runner_model, selects, serves
from trioshed.core.model import ModelSpec
from trioshed.errors import TrioshedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadReport:
    kept: tuple[str, ...]
    unloaded: tuple[str, ...]
    problems: int


def stale(loaded: list[ModelSpec], resolve: Callable[[str], ModelSpec]) -> list[ModelSpec]:
    """The loaded specs that no longer resolve to themselves (pure; ``resolve`` may raise).

    An adapter group's runner was started from its group's spec (:func:`runner_model`): it stays
    while its model resolves to the same runner but for the group's adapters, and the runner
    still holds the model's own (a group that grew since is served by a larger runner when a
    request needs one)."""
    out = []
    for spec in loaded:
        try:
            current = resolve(spec.name)
        except TrioshedError:
            current = None
        if current != spec and not _same_runner(spec, current):
            out.append(spec)
    return out


def _same_runner(runner: ModelSpec, current: ModelSpec | None) -> bool:
    if current is None or not selects(runner):
        return False
    grown = runner_model(current)
    return serves(runner, current) and replace(grown, adapters=runner.adapters, group=runner.group) == runner


async def reload_models(state: AppState) -> ReloadReport:
    """Re-read every ``models.toml`` now; unload the runners whose model changed."""
    catalogue = await trio.to_thread.run_sync(state.store.reload)
    loaded = state.scheduler.runner_models()
    changed = await trio.to_thread.run_sync(stale, loaded, state.store.resolve)
    async with trio.open_nursery() as nursery:
        for spec in {s.path: s for s in changed}.values():
            nursery.start_soon(state.scheduler.unload, spec)
    report = ReloadReport(
        kept=tuple(s.name for s in loaded if s not in changed),
        unloaded=tuple(s.name for s in changed),
        problems=len(catalogue.problems),
    )
    log.info(
        "models.toml reloaded: %d runner(s) kept, unloaded %s, %d problem(s)",
        len(report.kept), ", ".join(report.unloaded) or "none", report.problems,
    )  # fmt: skip
    return report


def reload_keys(state: AppState) -> None:
    """Re-read the keys file: a bad one is logged, naming the line, and the old keys stay."""
    if state.reload_keys is None or state.settings.keys_file is None:
        return
    try:
        state.reload_keys()
    except ValueError as exc:
        log.error("keys file not reloaded, the keys in force stay: %s", exc)
        return
    log.info("keys file %s reloaded", state.settings.keys_file)


async def reload_on_sighup(state: AppState) -> None:
    """Until cancelled: each SIGHUP reloads (one at a time; a burst coalesces into the next)."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            reload_keys(state)
            try:
                await reload_models(state)
            except TrioshedError as exc:
                log.warning("models.toml reload failed: %s", exc.message)
