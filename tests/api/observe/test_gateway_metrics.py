"""The model-server protocol on /metrics, read the way llm-d's endpoint picker reads it, by the
names of the engineConfigs entry shipped in packaging/kubernetes/epp-config.yaml (read here, so
that the config and the server cannot drift), from a real trioshed with real llama-server
children under load."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import add_tiny
from tests.support.paths import REPO
from trioshed.runner.occupancy import SlotOccupancy, occupancy_of
from trioshed.testing.server import open_test_server

EPP_CONFIG = REPO / "packaging" / "kubernetes" / "epp-config.yaml"
LONG_CTX = 131072  # a tiny model with this context streams for seconds: in flight while read
KEY = "gateway-test-key"

#: llama-server's GET /slots while one slot runs a task and the other holds an earlier one
#: (b10068, trimmed: the fields occupancy_of reads are as the binary sends them).
SLOTS = [
    {"id": 0, "n_ctx": 512, "is_processing": True, "id_task": 7, "n_prompt_tokens": 35, "next_token": [{"n_decoded": 8}]},
    {"id": 1, "n_ctx": 512, "is_processing": False, "id_task": 3, "n_prompt_tokens": 90, "next_token": [{"n_decoded": 40}]},
    {"id": 2, "n_ctx": 512, "is_processing": False},
]


def test_only_running_slots_hold_cells() -> None:
    assert occupancy_of(SLOTS) == SlotOccupancy(processing=1, tokens=43)
    assert occupancy_of([]) == SlotOccupancy()
    assert occupancy_of(["not a slot", {"is_processing": True}]) == SlotOccupancy(processing=1, tokens=0)


def engine() -> dict[str, Any]:
    """The engineConfigs entry the shipped picker config uses for trioshed's pods."""
    config = yaml.safe_load(EPP_CONFIG.read_text())
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    (entry,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    assert source["path"] == "/metrics"
    return dict(entry)


def spec(text: str) -> tuple[str, dict[str, str]]:
    """A metric spec as the picker parses it: ``name`` or ``name{label=value,...}``."""
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", text.strip())
    assert m is not None, text
    labels = dict(re.findall(r'(\w+)\s*=\s*"?([^",}]*)"?', m.group(2) or ""))
    return m.group(1), labels


def read(text: str, metric: str, *, newest: bool = False) -> tuple[float, dict[str, str]]:
    """One reading as the picker takes it: the family by name, a gauge (an untyped value reads
    as 0 there), the first series whose labels match (``newest``: the largest value, as for the
    LoRA info)."""
    name, labels = spec(metric)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert name in families, f"{name} is not on /metrics"
    family = families[name]
    assert family.type == "gauge", (name, family.type)
    matching = [s for s in family.samples if labels.items() <= s.labels.items()]
    assert matching, (name, labels)
    sample = max(matching, key=lambda s: s.value) if newest else matching[0]
    return sample.value, dict(sample.labels)


def test_the_engine_config_names_every_reading() -> None:
    entry = engine()
    for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec"):
        assert spec(entry[field])[0].startswith("trioshed:"), field


async def _stream(http: httpx.AsyncClient, body: dict[str, Any], started: trio.Event) -> None:
    async with http.stream("POST", "/api/generate", json=body) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        assert json.loads(await lines.__anext__())["done"] is False
        started.set()
        await trio.sleep_forever()  # holds its slot until the test cancels it


async def _waiter(http: httpx.AsyncClient, model: str) -> None:
    await http.post("/api/generate", json={"model": model, "prompt": "x", "stream": False, "options": {"num_predict": 1}})


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_the_picker_reads_queue_running_kv_and_adapters_under_load(model_store: Path) -> None:
    add_tiny(model_store, "long", context_length=LONG_CTX)
    entry = engine()
    prompt = "hello world " * 200
    with trio.fail_after(120):
        async with open_test_server(
            model_store, num_parallel=2, max_loaded_models=1, api_key=KEY, metrics_public=True
        ) as server, httpx.AsyncClient(
            base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as http, httpx.AsyncClient(base_url=server.base_url, timeout=60) as picker:  # the picker sends no key
            idle = (await picker.get("/metrics")).text
            assert read(idle, entry["queuedRequestsSpec"])[0] == 0
            assert read(idle, entry["runningRequestsSpec"])[0] == 0
            assert read(idle, entry["kvUsageSpec"])[0] == 0

            r = await http.post("/tokenize", json={"model": "long", "content": prompt})
            assert r.status_code == 200
            n_prompt = len(r.json()["tokens"])
            body = {"model": "long", "prompt": prompt, "raw": True, "options": {"num_predict": LONG_CTX // 2, "num_ctx": LONG_CTX, "temperature": 1, "seed": 1}}
            async with trio.open_nursery() as nursery:
                for _ in range(2):  # both slots of the one runner
                    started = trio.Event()
                    nursery.start_soon(_stream, http, body, started)
                    await started.wait()
                nursery.start_soon(_waiter, http, "long")  # waits for a slot
                nursery.start_soon(_waiter, http, "tiny")  # waits for room (one model at a time)
                await server.scheduler.wait_statistics(lambda s: s.queued == 2)
                before = time.time()
                text = (await picker.get("/metrics")).text
                stats = server.scheduler.statistics()
                nursery.cancel_scope.cancel(reason="read")

            assert read(text, entry["queuedRequestsSpec"])[0] == 2
            assert read(text, entry["runningRequestsSpec"])[0] == 2
            (runner,) = stats.runners
            cells = runner.options.kv_cells
            assert cells == 2 * LONG_CTX
            usage = read(text, entry["kvUsageSpec"])[0]
            # both running slots hold at least their prompt, at most prompt, BOS and the answer's budget
            assert 2 * n_prompt / cells <= usage <= 2 * (n_prompt + 1 + LONG_CTX // 2) / cells <= 1
            stamp, labels = read(text, entry["loraSpec"], newest=True)
            assert labels == {"running_lora_adapters": "long", "waiting_lora_adapters": "tiny", "max_lora": "1"}
            assert before - 5 <= stamp <= time.time()


async def test_metrics_need_a_key_unless_made_public(model_store: Path) -> None:
    with trio.fail_after(30):
        async with open_test_server(model_store, api_key=KEY) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.post("/api/show", json={"model": "tiny"})).status_code == 401
            r = await http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and read(r.text, engine()["runningRequestsSpec"])[0] == 0
        async with open_test_server(model_store, api_key=KEY, metrics_public=True) as server, httpx.AsyncClient(base_url=server.base_url) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.post("/api/show", json={"model": "tiny"})).status_code == 401  # only /metrics


def test_an_adapter_group_s_warm_models_are_running_adapters() -> None:
    """A group's runner serves each of its warm models without a load: each is listed running;
    a model waited for that no ready runner serves is waiting."""
    import math

    from trioshed.api.observe.gateway import adapters
    from trioshed.core.model import Placement
    from trioshed.scheduler.stats import MemberStats, QueueStats, RunnerStats, SchedulerStatistics

    group = RunnerStats(1, "a1:latest", "/m/base.gguf", "ready", 1, 2, 0, False, None, 300.0, math.inf, 1, 0, 512, 0.1,
                        Placement(0), None, None, members=(MemberStats("a2:latest", 1, math.inf), MemberStats("base:latest", 0, 10.0)),  # type: ignore[arg-type]
                        adapters=("/m/l1.gguf", "/m/l2.gguf"))  # fmt: skip
    stats = SchedulerStatistics(queued=2, leased=1, loaded=1, loading=0, unloading=0, runners=(group,), loads=1, unloads=0,
                                crashes=0, load_failures=0, rejected=0,
                                queue=(QueueStats("a2:latest", "", 1, 0.0), QueueStats("a5:latest", "", 1, 0.0)))  # fmt: skip
    assert adapters(stats) == (["a1", "a2", "base"], ["a5"])
