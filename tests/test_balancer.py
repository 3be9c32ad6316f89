"""packaging/haproxy.cfg: several trioshed nodes behind HAProxy, routed by model.

``haproxy -c`` checks the file as shipped; then HAProxy runs it (its addresses rewritten to free
loopback ports) in front of two real trioshed nodes, and every request for a model must reach
the one node that model hashes to: each model is loaded exactly once across the nodes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server

CONFIG = Path(__file__).resolve().parent.parent / "packaging" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin"))

needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")


@needs_haproxy
def test_shipped_config_is_valid() -> None:
    assert HAPROXY is not None
    result = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_routes_by_the_model_in_the_body_with_consistent_hashing() -> None:
    """The parts docs/service.md promises, whatever HAProxy version checks the syntax."""
    text = CONFIG.read_text()
    assert "option http-buffer-request" in text
    assert "json_query('$.model')" in text
    assert re.search(r"^\s*balance hdr\(X-Trioshed-Model\)", text, re.M)
    assert re.search(r"^\s*hash-type consistent", text, re.M)


@needs_haproxy
@pytest.mark.slow
async def test_haproxy_sends_each_model_to_one_node(tmp_path: Path) -> None:
    assert HAPROXY is not None
    store = tmp_path / "models"
    store.mkdir()
    names = ["m1", "m2", "m3"]  # odd: round-robin would send a model to both nodes
    for seed, name in enumerate(names):
        add_tiny(store, name, seed=seed)
    with trio.fail_after(120):
        async with open_test_server(store) as node1, open_test_server(store) as node2:
            front = free_port()
            config = CONFIG.read_text()
            config = re.sub(r"bind \S+", f"bind 127.0.0.1:{front}", config)
            config = re.sub(r"server node1 \S+", f"server node1 {node1.base_url.removeprefix('http://')}", config)
            config = re.sub(r"server node2 \S+", f"server node2 {node2.base_url.removeprefix('http://')}", config)
            cfg = tmp_path / "haproxy.cfg"
            cfg.write_text(config)
            log = (tmp_path / "haproxy.log").open("wb")
            proc = await trio.lowlevel.open_process([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front}", timeout=60) as http:
                    for _ in range(50):  # until HAProxy listens
                        try:
                            await http.get("/api/version")
                            break
                        except httpx.TransportError:
                            await trio.sleep(0.1)
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
            finally:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
                log.close()
            loads: Counter[str] = Counter()
            for node in (node1, node2):
                loads.update(r.model for r in node.scheduler.statistics().runners)
                assert node.scheduler.statistics().load_failures == 0
            # every model loaded on exactly one node, and both nodes got some
            assert loads == Counter({f"{n}:latest": 1 for n in names}), loads
            assert node1.scheduler.statistics().loads > 0 and node2.scheduler.statistics().loads > 0
