"""bench/fleet_sim.py runs (short, seeded) and its fleet routing beats consistent hashing."""

from __future__ import annotations

from bench.fleet_sim import Sim


def test_the_simulation_is_seeded_and_the_fleet_waits_less_than_hashing() -> None:
    fleet = Sim("fleet", 3, 1.0).run(60, 30)
    assert fleet == Sim("fleet", 3, 1.0).run(60, 30)  # seeded: the same figures every time
    hashed = Sim("hash", 3, 1.0).run(60, 30)
    assert fleet["requests"] == hashed["requests"] > 1000
    assert fleet["wait_p99_s"] < hashed["wait_p99_s"] and fleet["wait_p50_s"] <= hashed["wait_p50_s"]
    assert fleet["turns_on_their_node"] > 0.5
