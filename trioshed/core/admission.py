"""Whether a request may enter the scheduler, and the keep-alive it enters with (pure).

An API key (a tenant, :mod:`trioshed.keys`) may have at most ``max_concurrent`` requests in the
scheduler at once, queued or holding a slot, and ``max_queued`` of them waiting (the keys file;
0: no limit): past either, a new request gets :class:`~trioshed.errors.TooManyRequests` (429). The
queue as a whole holds at most TRIOSHED_MAX_QUEUE requests: past it, QueueFull (503). A request
queued again (its runner died, or failed its ping) was admitted once, and no limit refuses it now.

A request's keep-alive is its own, else its model's (``models.toml``, or ``Scheduler.pin`` for the
session, which makes a pinned model's keep-alive forever unless set), else TRIOSHED_KEEP_ALIVE.

The scheduler counts each tenant's requests (:class:`Tenant`) and asks these functions; it raises
what they return. No I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from trioshed.core.model import ModelSpec
from trioshed.errors import TooManyRequests


class Limits(Protocol):
    """An API key as admission sees it (:class:`trioshed.keys.ApiKey`)."""

    @property
    def name(self) -> str: ...
    @property
    def max_concurrent(self) -> int: ...
    @property
    def max_queued(self) -> int: ...


@dataclass
class Tenant:
    """An API key's requests in the scheduler now (its limits count these)."""

    queued: int = 0
    leased: int = 0


def concurrent_refusal(key: Limits, tenant: Tenant) -> TooManyRequests | None:
    """The 429 for a new request of ``key`` at its limit of requests at once (None: admitted)."""
    if key.max_concurrent and tenant.queued + tenant.leased >= key.max_concurrent:
        return TooManyRequests(key.name, "concurrent requests", key.max_concurrent)
    return None


def queued_refusal(key: Limits, tenant: Tenant) -> TooManyRequests | None:
    """The 429 for a new request of ``key`` that would wait, at its limit of waiting requests
    (None: it may wait)."""
    if key.max_queued and tenant.queued >= key.max_queued:
        return TooManyRequests(key.name, "queued requests", key.max_queued)
    return None


def queue_full(queued: int, bound: int) -> bool:
    """Whether the queue (``queued`` requests, TRIOSHED_MAX_QUEUE ``bound``) takes no more."""
    return queued >= bound


def keep_alive(requested: float | None, model: ModelSpec, default: float) -> float:
    """The request's own keep-alive, else the model's (models.toml), else TRIOSHED_KEEP_ALIVE."""
    if requested is not None:
        return requested
    return default if model.keep_alive is None else model.keep_alive


def pinned_for_session(model: ModelSpec, pinned: bool | None) -> ModelSpec:
    """``model`` as pin() left it (``pinned``; None: never pinned or unpinned this session):
    pinned, with keep-alive forever unless set, or unpinned."""
    if pinned is None or pinned == model.pinned:
        return model
    if pinned:
        return replace(model, pinned=True, keep_alive=math.inf if model.keep_alive is None else model.keep_alive)
    return replace(model, pinned=False, keep_alive=None if model.keep_alive == math.inf else model.keep_alive)
