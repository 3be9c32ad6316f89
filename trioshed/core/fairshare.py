"""The order in which waiting requests are planned: priority, then a weighted fair share of the
slots between tenants (API keys), then arrival.

:class:`FairShare` is the clock that stamps each request with its start tag when it arrives (the
scheduler stamps, and reports each dispatch); :func:`fair_order` sorts a pass's requests by
priority and those tags. Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence

from trioshed.core.views import RequestView


def fair_order(requests: Sequence[RequestView], *, now: float = 0.0, bound: float = 0.0) -> list[RequestView]:
    """Highest priority first; within a priority, by start tag (weighted fair order between
    tenants), ties in arrival order. One tenant: arrival order within a priority, as before.

    With a bound (``max_extra_wait`` > 0), priority is honest, not starvation: a request that
    has waited ``bound`` seconds is planned as if of the highest priority there is."""
    top = max((r.priority for r in requests), default=0)

    def priority(r: RequestView) -> int:
        return top if bound > 0 and now >= r.arrived + bound else r.priority

    if len({r.tenant for r in requests}) <= 1:
        return sorted(requests, key=lambda r: -priority(r))  # stable: arrival order within a priority
    return sorted(requests, key=lambda r: (-priority(r), r.share, r.id))


class FairShare:
    """Start-time fair queuing between tenants: each request gets a start tag when it arrives,
    ``max(now_virtual, its tenant's last finish)``, and its tenant's finish moves on by
    ``1 / weight``; the virtual clock is the largest tag dispatched so far. Requests served in
    tag order give each tenant with requests waiting a share of slots proportional to its
    weight, however many requests another tenant queues. Pure: the caller stamps and reports."""

    def __init__(self) -> None:
        self.virtual = 0.0
        self._finish: dict[str, float] = {}

    def arrive(self, tenant: str, weight: float) -> float:
        start = max(self.virtual, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + 1.0 / weight
        return start

    def dispatched(self, share: float) -> None:
        self.virtual = max(self.virtual, share)
