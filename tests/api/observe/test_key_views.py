"""What a key sees of others: a user key's status stream has neither the fleet (other nodes'
addresses, devices, errors) nor other keys' names; ``/metrics`` read without an admin key (where
TRIOSHED_METRICS_PUBLIC allows it) has no series by key name."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from tests.api.test_sharing import first_messages
from tests.conftest import add_tiny
from tests.e2e.fleet_nodes import open_fleet
from trioshed.api.observe.events import for_key
from trioshed.keys import ApiKey

ALICE = ApiKey("alice", "alice-secret-1")
BOSS = {"Authorization": "Bearer boss-secret-1"}


def test_a_user_keys_state_message_names_no_other_key_and_no_node() -> None:
    message = {
        "runners": [{"model": "m1:latest"}], "devices": [], "usage": [{"key": "bob"}, {"key": "alice"}],
        "queue": [{"model": "m1:latest", "key": "bob", "waiting": 2}, {"model": "m1:latest", "key": "alice", "waiting": 1}],
        "fleet": [{"name": "B", "url": "http://10.0.0.2:11434", "error": "", "devices": []}], "database": {"where": "x"},
    }  # fmt: skip
    for key in (ALICE, ApiKey("alice", "s", models=("m1*",))):
        seen = for_key(message, key)
        assert "fleet" not in seen and "database" not in seen
        assert [q["key"] for q in seen["queue"]] == ["", "alice"] and seen["usage"] == [{"key": "alice"}]
        assert "bob" not in str(seen)
    assert for_key(message, ApiKey("boss", "s", role="admin")) is message


async def test_a_user_key_on_a_fleet_node_and_a_public_metrics_read_see_no_one_else(tmp_path: Path) -> None:
    store = tmp_path / "models"
    add_tiny(store, "m1")
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "alice"\nkey = "alice-secret-1"\n')
    alice = {"Authorization": "Bearer alice-secret-1"}
    with trio.fail_after(60):
        async with open_fleet([store], names=("A", "B"), api_key="boss-secret-1", keys_file=keys, metrics_public=True) as (a, _b):
            async with httpx.AsyncClient(base_url=a.url, timeout=30) as http:
                gen = {"model": "m1", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
                assert (await http.post("/api/generate", json=gen, headers=alice)).status_code == 200
                assert "fleet" in (await first_messages(http, BOSS))["state"]
                seen = await first_messages(http, alice)
                assert "fleet" not in seen["state"] and "B" not in [n.get("name") for n in seen["state"].get("fleet", [])]
                public = (await http.get("/metrics")).text
                assert "trioshed_key_" not in public and "alice" not in public
                assert "trioshed_key_" not in (await http.get("/metrics", headers=alice)).text
                admin = (await http.get("/metrics", headers=BOSS)).text
                assert 'trioshed_key_requests_total{key="alice"' in admin
