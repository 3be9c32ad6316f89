"""The positions of a ring allocated once (``trioshed._util.RingIndex``), as the scheduler's
events, the log tail and the recent requests keep theirs."""

from __future__ import annotations

from trioshed._util import RingIndex


def test_an_empty_ring_holds_nothing() -> None:
    ring = RingIndex(3)
    assert (ring.held, ring.last(), list(ring.positions())) == (0, None, [])


def test_positions_go_oldest_first_and_the_oldest_is_replaced_once_full() -> None:
    ring = RingIndex(3)
    assert [ring.push() for _ in range(2)] == [0, 1]
    assert (ring.held, ring.last(), list(ring.positions())) == (2, 1, [0, 1])
    assert [ring.push() for _ in range(3)] == [2, 0, 1]  # the fourth and fifth take the oldest's
    assert (ring.held, ring.last(), list(ring.positions())) == (3, 1, [2, 0, 1])
