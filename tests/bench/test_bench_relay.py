"""The relay-ceiling and state-scale benchmarks' own machinery: what they count is
what was relayed. No timing is asserted here; the figures live in ``make bench``."""

from __future__ import annotations

import trio

from bench import relay, state_scale


async def test_every_token_the_stand_in_writes_reaches_the_client_in_each_protocol() -> None:
    with trio.fail_after(120):
        result = await relay.run(tokens=8, concurrency=(3,), requests=6,
                                 protocols=("ollama-generate", "ollama-chat", "openai-chat"))  # fmt: skip
    served = {row["protocol"] for row in result["rows"]}
    assert served == {"ollama-generate", "ollama-chat", "openai-chat"}
    for row in result["rows"]:
        assert row["failed"] == 0, row
        short, long = row["blocks"]
        assert (short["relayed"], long["relayed"]) == (6 * 1, 6 * 8), row  # the stand-in writes exactly n tokens
        # (no assertion on cpu_s: /proc counts CPU in 10 ms ticks, and 48 tokens can take less)


async def test_a_protocol_trioshed_does_not_serve_is_left_out_not_failed() -> None:
    with trio.fail_after(120):
        result = await relay.run(tokens=2, concurrency=(1,), requests=2, protocols=("native",))
    assert result["rows"] == []  # trioshed answers 404 on /completion: skipped, said in the log


async def test_state_scale_lists_every_model_and_runner(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(120):
        row = await state_scale.measure_point(30, 5, queued=10, calls=2, work=tmp_path)
    # measure_point itself asserts that /api/tags lists all 30 and /api/ps all 5
    assert {"ps_ms", "metrics_ms", "tags_ms", "tags_cold_ms", "pass_ms"} <= row.keys()


async def test_the_ceiling_relays_every_token_when_the_stand_in_writes_many_events_at_once() -> None:
    with trio.fail_after(120):
        result = await relay.run(tokens=40, concurrency=(2,), requests=4, burst=16,
                                 protocols=("ollama-generate", "openai-chat", "anthropic"))  # fmt: skip
    assert {row["protocol"] for row in result["rows"]} == {"ollama-generate", "openai-chat", "anthropic"}
    for row in result["rows"]:
        short, long = row["blocks"]
        assert row["failed"] == 0 and row["burst"] == 16, row
        assert (short["relayed"], long["relayed"]) == (4 * 1, 4 * 40), row  # 16 events per read, none lost or doubled


def test_the_targets_are_judged_at_the_ceiling_when_it_was_measured() -> None:
    def rows(value: int) -> dict[str, object]:
        return {"rows": [{"protocol": "openai-chat", "tokens_per_cpu_s": value}, {"protocol": "ollama-generate", "tokens_per_cpu_s": value}]}

    doc = {"standin": rows(30_000), "saturated": rows(120_000), "floor": {"rows": [{"tokens_per_cpu_s": 50_000}]},
           "floor_saturated": {"rows": [{"tokens_per_cpu_s": 250_000}]}}  # fmt: skip
    judged = {t["target"].split(":")[0]: (t["value"], t["met"], t["floor"]) for t in relay.targets(doc)}
    assert judged == {"openai-chat": (120_000, True, 250_000), "ollama-generate": (120_000, True, 250_000)}
    del doc["saturated"]  # an older document: the event-by-event table and its floor
    judged = {t["target"].split(":")[0]: (t["value"], t["met"], t["floor"]) for t in relay.targets(doc)}
    assert judged == {"openai-chat": (30_000, False, 50_000), "ollama-generate": (30_000, False, 50_000)}


def test_the_real_binary_targets_pair_each_stream_with_the_routers_and_judge_cpu_and_rate() -> None:
    def row(proxy: str, protocol: str, c: int, tok: int, us: float) -> dict[str, object]:
        return {"proxy": proxy, "protocol": protocol, "concurrency": c, "tokens_per_s": tok, "cpu_us_per_token_all_in": us}

    doc = {"real": {"rows": [
        row("trioshed", "ollama-generate", 16, 5000, 50.0), row("trioshed", "ollama-generate", 64, 4000, 60.0),
        row("trioshed", "openai-chat", 16, 3000, 40.0),
        row("router", "native", 16, 5200, 41.0), row("router", "native", 64, 4100, 47.0),
        row("router", "openai-chat", 16, 3300, 40.0),
    ]}}  # fmt: skip
    judged = {t["target"]: (t["value"], t["router"], t["met"]) for t in relay.targets(doc)}
    assert judged == {
        "CPU per relayed token, ollama-generate (real llama-server, 16 streams) <= 1.25x the router's": (50.0, 41.0, True),
        "aggregate tokens/s, ollama-generate (real llama-server, 16 streams) >= 0.95x the router's": (5000, 5200, True),
        "CPU per relayed token, ollama-generate (real llama-server, 64 streams) <= 1.25x the router's": (60.0, 47.0, False),
        "CPU per relayed token, openai-chat (real llama-server, 16 streams) <= 1.25x the router's": (40.0, 40.0, True),
        "aggregate tokens/s, openai-chat (real llama-server, 16 streams) >= 0.95x the router's": (3000, 3300, False),
    }
