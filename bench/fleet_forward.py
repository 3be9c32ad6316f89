"""What forwarding costs: a request sent straight to the node serving it against the same request
arriving at another node of the fleet and forwarded (one hop), at concurrency 1.

``python -m bench.fleet_forward [--requests N]`` starts two trioshed processes over the stand-in
upstream (:mod:`bench.standin`: it answers at once, so the figures are trioshed's own cost): B
serves the model (warm), A knows B as a peer. Requests rotate, B direct, through A and through
the bare forwarder (below), so each triple saw the same machine state; the median of the paired
differences is the hop's cost.
Two kinds: a whole answer (``"stream": false``) and a stream of 16 tokens (to its last byte),
both on ``/api/generate``. Beside them, the same requests through a bare forwarder
(:mod:`bench.bare_forward`: the same HTTP layer and client relaying bytes, with no gate, routing,
trace or log): the stack's own floor for a hop, measured in the same run. Beside them, what
signing a forwarded request costs alone (:func:`signing_cost`: the body's digest and the HMAC
on the sending node, the checks on the serving one, in process CPU). Writes
``bench/results/<date>-fleet-forward.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import procs
from bench.standin import write_wrapper
from bench.stats import percentile

SECRET = "bench-fleet-secret"
RESULTS = Path(__file__).resolve().parent / "results"


async def _timed(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with http.stream("POST", url + "/api/generate", json=body) as response:
        async for _ in response.aiter_raw():
            pass
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    return elapsed


@asynccontextmanager
async def open_bare_forward(
    upstream: str, log_dir: Path, *, llama_server: bool = False, extra_env: Mapping[str, str] | None = None
) -> AsyncIterator[procs.Server]:
    """:mod:`bench.bare_forward` in front of ``upstream`` (a trioshed node, or a ``llama_server``);
    ``extra_env`` over this process's environment (its ``PYTHONPATH`` after this checkout's)."""
    port = procs.free_port()
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([procs._REPO, env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "bench.bare_forward", "--port", str(port), "--upstream", upstream, *(["--llama-server"] if llama_server else [])]
    ready_path = "/health" if llama_server else "/api/version"
    async with procs.open_server(
        "bare-forward", argv, env=env, base_url=f"http://127.0.0.1:{port}", ready_path=ready_path,
        log_path=log_dir / f"bare-forward-{port}.log", ready_timeout=60,
    ) as server:  # fmt: skip
        yield server


def signing_cost(body: bytes, rounds: int = 20000) -> dict[str, float]:
    """Process CPU per request, in microseconds, of signing a forwarded request of ``body``
    (its digest and the HMAC: the sending node) and of checking it (the signature, the window,
    the nonce, then the body's digest: the serving node)."""
    import contextvars

    from trioshed.fleet.auth import FleetAuth, body_digest

    a, b = FleetAuth(SECRET, "A"), FleetAuth(SECRET, "B")
    started = time.process_time()
    signed = [a.sign("POST", "/api/generate", body_digest(body), to="B", key="alice") for _ in range(rounds)]
    sign = time.process_time() - started
    started = time.process_time()
    for headers in signed:  # each in a context of its own, as each request's task has
        contextvars.copy_context().run(lambda h=headers: b.check_body(b.verify("POST", "/api/generate", h.get), body))
    verify = time.process_time() - started
    return {"body_bytes": len(body), "sign_us": 1e6 * sign / rounds, "verify_us": 1e6 * verify / rounds}


async def run(requests: int = 300) -> dict[str, Any]:
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="fleet-forward-") as tmp:
        base = Path(tmp)
        models = base / "models"
        models.mkdir()
        write_tiny_model(models / "tiny.gguf")
        flags = procs.RunnerFlags(parallel=1, ctx_per_slot=64)
        env = {"TRIOSHED_LLAMA_SERVER": str(write_wrapper(base)), "TRIOSHED_FLEET_SECRET": SECRET, "TRIOSHED_FLEET_INTERVAL": "0.2"}
        async with procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env={**env, "TRIOSHED_NODE_NAME": "B"}, name="B") as b:
            a_env = {**env, "TRIOSHED_NODE_NAME": "A", "TRIOSHED_PEERS": b.base_url}
            async with (
                procs.open_trioshed(models, flags, base / "logs", max_loaded=1, extra_env=a_env, name="A") as a,
                open_bare_forward(b.base_url, base / "logs") as bare,
                httpx.AsyncClient(timeout=60) as http,
            ):
                whole = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
                stream = {"model": "tiny", "prompt": "hi", "stream": True, "options": {"num_predict": 16}}
                await _timed(http, b.base_url, whole)  # loads the model on B
                await trio.sleep(1.0)  # A reads B's state (every 0.2 s)
                for _ in range(20):  # warm-up, every way
                    await _timed(http, b.base_url, whole)
                    await _timed(http, a.base_url, whole)
                    await _timed(http, bare.base_url, whole)
                ps = (await http.get(a.base_url + "/api/ps")).json()
                if ps["models"]:
                    raise RuntimeError("A loaded the model itself: nothing was forwarded")
                rows = {}
                for kind, body in (("whole", whole), ("stream (16 tokens)", stream)):
                    taken: dict[str, list[float]] = {"direct": [], "forwarded": [], "floor": []}
                    for i in range(requests):  # each triple in a rotated order: none always first
                        order = [("direct", b), ("forwarded", a), ("floor", bare)]
                        for name, server in order[i % 3 :] + order[: i % 3]:
                            taken[name].append(await _timed(http, server.base_url, body))
                    direct, forwarded, floor = taken["direct"], taken["forwarded"], taken["floor"]
                    deltas = [f - d for d, f in zip(direct, forwarded, strict=True)]
                    floor_deltas = [f - d for d, f in zip(direct, floor, strict=True)]
                    rows[kind] = {
                        "direct_p50_ms": 1000 * statistics.median(direct),
                        "forwarded_p50_ms": 1000 * statistics.median(forwarded),
                        "added_p50_ms": 1000 * statistics.median(deltas),
                        "added_p90_ms": 1000 * (percentile(deltas, 90) or 0.0),
                        "floor_p50_ms": 1000 * statistics.median(floor),
                        "floor_added_p50_ms": 1000 * statistics.median(floor_deltas),
                        "floor_added_p90_ms": 1000 * (percentile(floor_deltas, 90) or 0.0),
                    }
    signing = [signing_cost(b'{"model":"tiny","prompt":"' + b"x" * size + b'"}') for size in (20, 4096, 65536)]
    return {"requests": requests, "rows": rows, "signing": signing}


def report(result: dict[str, Any], note: str) -> str:
    lines = [
        f"# Forwarding cost at c=1 ({datetime.date.today()})", "",
        f"{result['requests']} requests of each kind, rotating: direct to the serving node (B), through "
        "another node (A, one hop) and through a bare forwarder; trioshed over the stand-in upstream. " + note, "",
        "| answer | direct p50 | through A p50 | added p50 (paired) | added p90 (paired) "
        "| through a bare forwarder p50 | its added p50 (paired) | its added p90 (paired) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for kind, row in result["rows"].items():
        lines.append(
            f"| {kind} | {row['direct_p50_ms']:.2f} ms | {row['forwarded_p50_ms']:.2f} ms | "
            f"{row['added_p50_ms']:.2f} ms | {row['added_p90_ms']:.2f} ms | {row['floor_p50_ms']:.2f} ms | "
            f"{row['floor_added_p50_ms']:.2f} ms | {row['floor_added_p90_ms']:.2f} ms |"
        )
    lines += [
        "", "The bare forwarder (`bench/bare_forward.py`) is the same HTTP layer and client relaying "
        "bytes, with nothing else: its added time is the stack's floor for a hop on this machine.",
        "", "Signing alone (process CPU per request, in process): the sending node's body digest and HMAC, "
        "the serving node's checks (signature, window, nonce, the body's digest).", "",
        "| body | sign | check |", "| ---: | ---: | ---: |",
        *(f"| {s['body_bytes']:,} bytes | {s['sign_us']:.1f} us | {s['verify_us']:.1f} us |" for s in result.get("signing", [])),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--note", default="", help="a word on the machine (e.g. how loaded it was)")
    args = parser.parse_args()
    result = trio.run(run, args.requests)
    text = report(result, args.note)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{datetime.date.today()}-fleet-forward.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
