"""packaging/haproxy.cfg: several trioshed nodes behind HAProxy.

``haproxy -c`` checks the file as shipped; then HAProxy runs its by-model backend (its addresses
rewritten to free loopback ports) in front of two real trioshed nodes that form no fleet, and
every request for a model must reach the one node that model hashes to: each model is loaded
exactly once across the nodes. The fleet backend is run by tests/e2e/test_fleet_e2e.py.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.support.haproxy import CONFIG, HAPROXY, needs_haproxy, run_haproxy
from trioshed.testing.server import open_test_server


@needs_haproxy
def test_shipped_config_is_valid() -> None:
    assert HAPROXY is not None
    result = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_routes_by_the_model_in_the_body_with_consistent_hashing() -> None:
    """The parts docs/service.md promises, whatever HAProxy version checks the syntax: a fleet
    backend spreading connections (the default), and a by-model backend for independent nodes."""
    text = CONFIG.read_text()
    assert re.search(r"^\s*default_backend trioshed_fleet", text, re.M)
    assert re.search(r"^backend trioshed_fleet\n\s*balance leastconn", text, re.M)
    assert "option http-buffer-request" in text
    assert "json_query('$.model')" in text
    assert re.search(r"^\s*balance hdr\(X-Trioshed-Model\)", text, re.M)
    assert re.search(r"^\s*hash-type consistent", text, re.M)


@needs_haproxy
@pytest.mark.slow
async def test_haproxy_sends_each_model_to_one_node(tmp_path: Path) -> None:
    """The by-model backend, for nodes that form no fleet."""
    store = tmp_path / "models"
    store.mkdir()
    names = ["m1", "m2", "m3"]  # odd: round-robin would send a model to both nodes
    for seed, name in enumerate(names):
        add_tiny(store, name, seed=seed)
    with trio.fail_after(120):
        async with open_test_server(store) as node1, open_test_server(store) as node2:
            async with run_haproxy(tmp_path, [node1.base_url, node2.base_url], "trioshed_by_model") as front:
                async with httpx.AsyncClient(base_url=front, timeout=60) as http:
                    for _ in range(3):
                        for name in names:
                            model = name if _ % 2 else f"{name}:latest"  # both spellings hash alike
                            body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
                            response = await http.post("/api/generate", json=body)
                            assert response.status_code == 200, response.text
                    # a client-set header routes without the body being read
                    response = await http.post(
                        "/api/generate",
                        json={"prompt": "hi", "stream": False, "options": {"num_predict": 2}, "model": "m1"},
                        headers={"X-Trioshed-Model": "m1"},
                    )
                    assert response.status_code == 200
            loads: Counter[str] = Counter()
            for node in (node1, node2):
                loads.update(r.model for r in node.scheduler.statistics().runners)
                assert node.scheduler.statistics().load_failures == 0
            # every model loaded on exactly one node, and both nodes got some
            assert loads == Counter({f"{n}:latest": 1 for n in names}), loads
            assert node1.scheduler.statistics().loads > 0 and node2.scheduler.statistics().loads > 0
