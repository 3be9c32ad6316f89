"""The relay-ceiling and state-scale benchmarks' own machinery (issue 20): what they count is
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
