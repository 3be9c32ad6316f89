"""The load-test harness (``bench/``): its pure parts, and one tiny run against a real server.

The benchmarks themselves run only under ``make bench``; here the harness runs a few requests
against a server started in the test and the JSON it writes is checked.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from bench import report
from bench.load import Scenario, Target, blocks_table, load_scenarios, parse_target
from bench.procs import RunnerFlags, open_trioshed
from bench.protocol import parse_full_body, parse_stream_line, request_body
from bench.stats import RequestRecord, paired_deltas, percentile, summarize
from tests.support.paths import REPO

# ---------------------------------------------------------------- pure parts


def test_percentile_interpolates_and_handles_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def _rec(total: float | None, status: int | None = 200, **kw: object) -> RequestRecord:
    rec = RequestRecord(target="t", model="m", api="native", start=0.0, status=status, total=total)
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_summarize_counts_statuses_lost_and_rates() -> None:
    recs = [
        _rec(0.010, tokens=8, ttft=0.002, ttfb=0.001),
        _rec(0.020, tokens=8, ttft=0.004, ttfb=0.001),
        _rec(0.005, status=503, error="busy"),
        _rec(None, status=None, error="timeout after 1 s"),
    ]
    s = summarize(recs, wall=0.5)
    assert (s.n, s.ok, s.lost) == (4, 2, 1)
    assert s.by_status == {"200": 2, "503": 1, "lost": 1}
    assert s.req_s == 4.0
    assert s.tok_s == 32.0
    assert s.p50 == 15.0
    assert s.ttft_p50 == 3.0
    # (8 - 1) tokens over (0.010 - 0.002) s and (0.020 - 0.004) s
    assert s.stream_tok_s == pytest.approx((875.0 + 437.5) / 2, rel=1e-3)
    assert s.errors == {"busy": 1, "timeout after 1 s": 1}


def test_paired_deltas_skip_failed_pairs() -> None:
    a = [_rec(0.010), _rec(0.010), _rec(0.010, status=500)]
    b = [_rec(0.011), _rec(None, status=None), _rec(0.012)]
    assert paired_deltas(a, b) == [pytest.approx(0.001)]


@pytest.mark.parametrize(
    ("api", "lines", "tokens", "final"),
    [
        (
            "ollama-generate",
            [b'{"response":"a","done":false}', b'{"response":"b","done":false}',
             b'{"response":"","done":true,"eval_count":2}'],
            2, True,
        ),
        (
            "ollama-chat",
            [b'{"message":{"content":"a"},"done":false}', b'{"done":true,"eval_count":1}'],
            1, True,
        ),
        (
            "native",
            [b'data: {"content":"a","stop":false}', b"", b'data: {"content":"","stop":true,"timings":{"predicted_n":1}}'],
            1, True,
        ),
        (
            "openai-chat",
            [b'data: {"choices":[{"delta":{"role":"assistant","content":null}}]}',
             b'data: {"choices":[{"delta":{"content":"a"}}]}',
             b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}',
             b'data: {"choices":[],"usage":{"completion_tokens":1}}', b"data: [DONE]"],
            1, True,
        ),
    ],
)  # fmt: skip
def test_stream_parsing_counts_tokens_and_finds_the_end(
    api: str, lines: list[bytes], tokens: int, final: bool
) -> None:
    chunks = [c for c in (parse_stream_line(api, line) for line in lines) if c is not None]
    assert sum(c.token for c in chunks) == tokens
    assert any(c.final for c in chunks) == final
    reported = [c.tokens for c in chunks if c.tokens is not None]
    assert reported == [tokens]


def test_stream_errors_and_full_bodies() -> None:
    err = parse_stream_line("ollama-generate", b'{"error":"model not found"}')
    assert err is not None and err.error == "model not found" and err.final
    err = parse_stream_line("native", b'data: {"error":{"code":500,"message":"boom"}}')
    assert err is not None and err.error == "boom"
    assert parse_full_body("openai-chat", b'{"usage":{"completion_tokens":5}}') == (5, None)
    assert parse_full_body("ollama-generate", b'{"eval_count":3,"done":true}') == (3, None)
    assert parse_full_body("native", b'{"timings":{"predicted_n":4}}') == (4, None)
    assert parse_full_body("native", b"nope")[1] is not None


def test_request_bodies_carry_model_limit_and_temperature() -> None:
    body = request_body("ollama-generate", "m", "hi", 8, True)
    assert body == {"model": "m", "prompt": "hi", "stream": True,
                    "options": {"num_predict": 8, "temperature": 0}}  # fmt: skip
    assert request_body("native", "m", "hi", 8, False)["n_predict"] == 8
    assert request_body("openai-chat", "m", "hi", 8, True)["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="unknown api"):
        request_body("grpc", "m", "hi", 8, True)


def test_targets_are_loopback_only_and_parse_from_the_command_line() -> None:
    t = parse_target("a=http://127.0.0.1:8080,native", "ollama-generate")
    assert (t.name, t.base_url, t.api) == ("a", "http://127.0.0.1:8080", "native")
    assert parse_target("http://localhost:1", "openai-chat").api == "openai-chat"
    with pytest.raises(ValueError, match="loopback"):
        Target("x", "http://10.0.0.1:80")
    direct = Target("d", "http://127.0.0.1:1", model_urls=(("b", "http://127.0.0.1:2/"),))
    assert direct.url_for("b") == "http://127.0.0.1:2"
    assert direct.url_for("a") == "http://127.0.0.1:1"


def test_scenarios_are_bounded_and_load_from_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Scenario(name="x", models=("m",), n=0)
    with pytest.raises(ValueError):
        Scenario(name="x", models=())
    path = tmp_path / "s.toml"
    path.write_text('[[scenario]]\nname = "hot"\nmodels = ["a", "b"]\nn = 4\nconcurrency = 2\n')
    (sc,) = load_scenarios(path, Scenario(name="d", models=("z",), n_predict=3))
    assert (sc.name, sc.models, sc.n, sc.concurrency, sc.n_predict) == ("hot", ("a", "b"), 4, 2, 3)
    path.write_text('[[scenario]]\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown keys"):
        load_scenarios(path, sc)


def test_summary_rows_report_ratios_to_direct_and_targets() -> None:
    def s(**kw: object) -> dict[str, object]:
        return {"summary": {"n": 10, "ok": 10, **kw}}

    results = {
        "overhead-generate": {"per_target": {
            "direct": s(p50=10.0),
            "router": {**s(p50=11.2), "paired_delta_ms": {"p50": 1.2}},
            "trioshed": {**s(p50=10.5), "paired_delta_ms": {"p50": 0.5}},
        }},
        "throughput-c16": {"per_target": {
            "direct": s(req_s=100.0, p99=50.0), "router": s(req_s=80.0, p99=70.0),
            "trioshed": s(req_s=98.0, p99=52.0),
        }},
        "overload": {"per_target": {
            "direct": {"answered": 48, "busy_503": 0, "other_5xx": 0, "lost": 0},
            "trioshed": {"answered": 12, "busy_503": 36, "other_5xx": 0, "lost": 0},
        }, "trioshed_max_queue": 8},
    }  # fmt: skip
    rows = {r["metric"]: r for r in report.summary_rows(results)}
    over = rows["overhead c=1 p50 ms (generate)"]
    assert over["ratio"] == {"router": 1.12, "trioshed": 1.05}
    assert over["met"] is True
    assert rows["req/s c=16"]["ratio"]["trioshed"] == 0.98
    assert rows["req/s c=16"]["met"] is True
    assert rows["overload: answered/503/other 5xx/lost"]["values"]["trioshed"] == "12/36/0/0"
    table = report.summary_markdown({"meta": {"mode": "quick"}, "summary": list(rows.values())})
    assert "| req/s c=16 | 100.00 | 80.00 | 98.00 | 0.800 | 0.980 |" in table


def test_blocks_table_has_a_row_per_block() -> None:
    from bench.load import Block

    b = Block("s", "t", 0, 1.0, [_rec(0.01, tokens=8)])
    table = blocks_table([b, b])
    assert table.count("| s | t | 0 | 1 | 1 | 0 |") == 2


# ---------------------------------------------------------------- one tiny run against a real server


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Target]:
    """``python -m trioshed serve`` over one tiny model, spoken to with Ollama's /api/generate."""
    from trioshed.testing.tiny import write_tiny_model

    models = tmp_path / "models"
    write_tiny_model(models / "tiny.gguf", name="tiny")
    flags = RunnerFlags(threads=1, parallel=2, ctx_per_slot=256)
    async with open_trioshed(models, flags, tmp_path / "logs", max_loaded=1, ready_timeout=20.0) as srv:
        yield Target("trioshed", srv.base_url, "ollama-generate")


@pytest.mark.slow
async def test_load_cli_runs_a_tiny_scenario_and_writes_json(server: Target, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = [
        sys.executable, "-m", "bench.load", "--target", f"{server.name}={server.base_url},{server.api}",
        "--model", "tiny", "-n", "6", "-c", "2", "--n-predict", "8", "--timeout", "20",
        "--max-seconds", "25", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    with trio.fail_after(30):
        proc = await trio.run_process(argv, cwd=REPO, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    doc = json.loads(out.read_text())
    assert doc["tool"] == "bench.load"
    assert doc["targets"] == [{"name": server.name, "base_url": server.base_url, "api": server.api, "model_urls": []}]
    (block,) = doc["blocks"]
    s = block["summary"]
    assert (s["n"], s["ok"], s["lost"], s["by_status"]) == (6, 6, 0, {"200": 6})
    assert s["p50"] is not None and 0 < s["p50"] <= s["p99"]
    for rec in block["records"]:
        assert rec["status"] == 200 and rec["error"] is None
        assert rec["tokens"] == 8  # tiny models never emit </s>: every answer runs to its limit
        assert 0 < rec["ttfb"] <= rec["ttft"] <= rec["total"]
    assert "| load | trioshed | 0 | 6 | 6 | 0 |" in proc.stdout.decode()


@pytest.mark.slow
async def test_timed_block_stops_on_time_and_records_everything(server: Target) -> None:
    from bench.load import open_client, run_block

    sc = Scenario(name="timed", models=("tiny",), n=10_000, concurrency=2, n_predict=4,
                  timeout=10.0, max_seconds=10.0, duration=0.5)  # fmt: skip
    async with open_client() as client:
        with trio.fail_after(15):
            block = await run_block(client, server, sc, t0=trio.current_time(), progress=False)
    assert 0.5 <= block.wall < 5.0
    assert 0 < block.summary.n == block.summary.ok < 10_000


@pytest.mark.slow
async def test_compare_smoke_writes_results_with_ratios(tmp_path: Path) -> None:
    """``bench.compare`` end to end on the smallest plan: direct and trioshed, overhead and
    throughput only; the JSON carries per-target summaries and ratio rows, and no llama-server
    is left behind."""
    argv = [
        sys.executable, "-m", "bench.compare", "--smoke", "--targets", "direct,trioshed",
        "--groups", "steady", "--out", str(tmp_path),
    ]  # fmt: skip
    with trio.fail_after(60):
        proc = await trio.run_process(argv, cwd=REPO, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    (path,) = [p for p in tmp_path.iterdir() if p.name.endswith("-smoke.json")]  # noqa: ASYNC240
    doc = json.loads(path.read_text())
    assert doc["meta"]["leaked_llama_servers"] == []
    assert doc["unavailable"] == {}
    over = doc["results"]["overhead-generate"]["per_target"]
    assert set(over) == {"direct", "trioshed", "floor-raw", "floor-hypercorn", "floor-quart", "floor-forward"}
    assert over["trioshed"]["summary"]["ok"] == over["trioshed"]["summary"]["n"] == 5
    # the inbound floor answered the same requests, and its row is in the summary
    assert over["floor-quart"]["summary"]["ok"] == over["floor-hypercorn"]["summary"]["ok"] == 5
    assert over["floor-raw"]["summary"]["ok"] == 5
    # so did the bare forwarder in front of the direct server, in both families
    assert over["floor-forward"]["paired_delta_ms"]["n"] == 5
    assert doc["results"]["overhead-chat"]["per_target"]["floor-forward"]["summary"]["ok"] == 5
    assert over["trioshed"]["paired_delta_ms"]["n"] == 5
    rows = {r["metric"]: r for r in doc["summary"]}
    assert rows["req/s c=4"]["ratio"]["trioshed"] > 0
    assert any(m.startswith("inbound floor") for m in rows)
    assert any(m.startswith("proxy floor") for m in rows)
    assert {r["scenario"] for r in doc["records"]} >= {"overhead-generate", "overhead-chat", "throughput-c4"}
    assert (tmp_path / path.name.replace(".json", ".md")).is_file()
    assert (tmp_path / path.name.replace(".json", "-ratios.png")).is_file()


def test_ollama_raw_is_generate_without_a_template() -> None:
    body = request_body("ollama-raw", "m", "hi", 8, True)
    assert body["raw"] is True and body["options"]["num_predict"] == 8
    assert "raw" not in request_body("ollama-generate", "m", "hi", 8, True)
    done = parse_stream_line("ollama-raw", b'{"done":true,"eval_count":8}')
    assert done is not None and done.final and done.tokens == 8
