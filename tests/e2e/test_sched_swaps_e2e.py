"""Swap-aware dispatch end to end: real llama-server children (tiny models, one thread), the
issue's burst (24 requests at once cycling over 3 models, room for one runner with 2 slots),
with the default TRIOSHED_MAX_EXTRA_WAIT and with 0 (arrival order)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.testing.server import open_test_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

MODELS = ("one", "two", "three")


async def burst(store: Path, **overrides: object) -> tuple[int, list[str]]:
    """The loads the burst cost and the models in the order their answers came."""
    answered: list[str] = []
    with trio.fail_after(180):
        async with open_test_server(store, max_loaded_models=1, num_parallel=2, **overrides) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

                async def one(model: str) -> None:
                    body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2, "temperature": 0}}
                    r = await http.post("/api/generate", json=body)
                    assert r.status_code == 200, r.text
                    answered.append(model)

                async with trio.open_nursery() as nursery:
                    for i in range(24):
                        nursery.start_soon(one, MODELS[i % 3])
            return server.scheduler.statistics().loads, answered


async def test_the_burst_costs_three_loads_by_default_and_more_in_arrival_order(tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    for seed, name in enumerate(MODELS, start=1):
        add_tiny(store, name, seed=seed)
    loads, answered = await burst(store)  # the default bound (5 s) covers this burst
    assert loads <= 2 * 3, answered
    strict, _ = await burst(store, max_extra_wait=0.0)
    assert strict > loads
