"""How much of a runner's KV cache its running requests hold: read from llama-server's ``GET /slots``.

llama-server (b10068, checked against the binary in ``tests/api/observe/test_gateway_metrics.py``) answers
``GET /slots`` with one object per slot: ``n_ctx`` (the slot's context), ``is_processing``
while a task runs in it, and once a task has run there ``n_prompt_tokens`` (its whole prompt,
the part reused from the cache included) and ``next_token[0].n_decoded`` (tokens generated so
far). A slot running a task holds ``n_prompt_tokens + n_decoded`` KV cells.

Only running slots count. An idle slot keeps its last prompt in the cache for reuse, but the
next task takes those cells over (reused or overwritten) and never waits for them: like vLLM's
``kv_cache_usage_perc``, whose freed blocks stay cached yet count as free, the figure says how
much of the cache the work in flight is using, which is what a router balancing load wants.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trioshed.runner.client import ConnectionFailed

__all__ = ["SlotOccupancy", "occupancy_of", "read_occupancy"]


@dataclass(frozen=True)
class SlotOccupancy:
    """A runner's slots at one moment: how many run a task, and the KV cells those hold."""

    processing: int = 0
    tokens: int = 0


class _Gets(Protocol):
    async def get(self, path: str) -> tuple[int, bytes]: ...


def occupancy_of(slots: Sequence[Any]) -> SlotOccupancy:
    """The occupancy a ``GET /slots`` answer describes (entries that are not slots are skipped)."""
    processing = tokens = 0
    for slot in slots:
        if not isinstance(slot, dict) or not slot.get("is_processing"):
            continue
        processing += 1
        decoded = sum(int(n.get("n_decoded") or 0) for n in slot.get("next_token") or () if isinstance(n, dict))
        tokens += int(slot.get("n_prompt_tokens") or 0) + decoded
    return SlotOccupancy(processing, tokens)


async def read_occupancy(upstream: _Gets) -> SlotOccupancy | None:
    """Ask a runner for its slots; None when it cannot say (it is stopping, or answers oddly).

    Cancellation: nothing to clean up; the caller bounds the wait."""
    try:
        status, raw = await upstream.get("/slots")
    except ConnectionFailed:
        return None
    if status != 200:
        return None
    try:
        slots = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(slots, list):
        return None
    return occupancy_of(slots)
