"""``/api/ps`` size against llama.cpp's own buffers, with real ``llama-server`` children.

The size trioshed shows for a runner is what that child reported allocating: the sum of every
``buffer size =`` line it printed while loading (model, KV, output and compute buffers), read here
from the child's own output (logged at DEBUG), not from trioshed's parser. ``/api/ps`` also shows
the settings the size depends on: ``kv_cells`` (llama-server's ``--ctx-size``) is ``num_ctx``
per slot times ``num_parallel``, and flash attention is off unless TRIOSHED_FLASH_ATTENTION.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
import trio

from trioshed.testing.server import open_test_server

pytestmark = pytest.mark.slow

_BUFFER = re.compile(r"buffer size = +([0-9.]+) MiB")
MiB = 1024 * 1024


def child_buffers(records: list[logging.LogRecord], pid: int) -> tuple[float, list[str]]:
    """Bytes summed over the ``buffer size =`` lines that child ``pid`` printed."""
    lines = [r.getMessage() for r in records if r.name == "trioshed.runner.output"]
    mine = [ln for ln in lines if f"[{pid}] " in ln and "buffer size =" in ln]
    return sum(float(m[1]) for ln in mine if (m := _BUFFER.search(ln))) * MiB, mine


@pytest.mark.parametrize(("num_ctx", "num_parallel"), [(2048, 1), (8192, 2)])
async def test_ps_size_is_the_childs_own_buffers(
    gemma_store: Path, caplog: pytest.LogCaptureFixture, num_ctx: int, num_parallel: int
) -> None:
    caplog.set_level(logging.DEBUG, logger="trioshed.runner.output")
    with trio.fail_after(180):
        async with (
            open_test_server(gemma_store, num_parallel=num_parallel) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=120) as http,
        ):
            body = {"model": "gemma3-270m", "prompt": "Hi", "stream": False,
                    "options": {"num_ctx": num_ctx, "num_predict": 1}}  # fmt: skip
            assert (await http.post("/api/generate", json=body)).status_code == 200
            (ps,) = (await http.get("/api/ps")).json()["models"]
            (stats,) = server.scheduler.statistics().runners
            assert stats.pid is not None
            reported, lines = child_buffers(caplog.records, stats.pid)
            # model (mapped + repacked), KV (two caches: sliding window), output, compute
            assert len(lines) >= 5, lines
            assert ps["size"] == pytest.approx(reported, rel=0.03), (ps, lines)
            runner = ps["runner"]
            assert runner["size_source"] == "measured"
            assert (runner["num_ctx"], runner["num_parallel"]) == (num_ctx, num_parallel)
            assert runner["kv_cells"] == num_ctx * num_parallel  # llama-server's --ctx-size
            assert runner["flash_attention"] is True and runner["kv_cache_type"] == "f16"
            assert ps["context_length"] == num_ctx
            show = (await http.post("/api/show", json={"model": "gemma3-270m"})).json()["model_info"]
            assert show["trioshed.runner.num_parallel"] == num_parallel
            assert show["trioshed.runner.kv_cells"] == show["trioshed.runner.num_ctx"] * num_parallel
