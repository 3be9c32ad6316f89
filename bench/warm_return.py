"""Warm returns: the next message of a long chat whose model was swapped out, with
and without restoring its saved slot.

trioshed served in-process with room for one runner (``TRIOSHED_MAX_LOADED_MODELS=1``) and warm
returns on (``TRIOSHED_KV_CACHE_BUDGET``, a temporary ``TRIOSHED_KV_CACHE_DIR``). A chat of about
2,000 tokens of history on Gemma 3 270M; each sample:

1. a request for another model (``tiny``) swaps Gemma out: its slot (the history, the last
   message and its answer) is saved;
2. the next user message (a new one each time, after the same history) is sent, streamed, and
   the time to its first token is taken, Gemma's load included (reported apart, from the
   scheduler's ``ready`` event). In the *restore* arm the saved
   file is there and is restored before the request; in the *recompute* arm the saved files are
   deleted first, so the whole history is computed again, as on a trioshed without warm returns.

The arms alternate (ABBA...) in one run, so drift on a shared machine hits both. Reported: time to
first token per arm (median, each sample), the tokens llama-server found cached, and the saved
file's size.

Run: ``python -m bench.warm_return [--pairs 5] [--threads 2] [--models DIR] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1024**2
#: ~2,000 tokens of history: alternating turns of plain prose.
TURN = (
    "Tell me more about how rivers shape the land around them, from the mountains where they "
    "start to the deltas where they meet the sea, and about the towns that grew up on their banks. "
)
REPLY = (
    "Rivers carve valleys, carry sediment downstream, and build plains and deltas where they slow "
    "down; towns grew on their banks for water, trade and fertile soil, and bridges and ports "
    "followed. "
)


def history(turns: int = 12) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a patient geography teacher."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i + 1}. {TURN * 2}"})
        messages.append({"role": "assistant", "content": REPLY * 2})
    return messages


async def next_message(http: Any, messages: list[dict[str, str]], question: str) -> dict[str, Any]:
    """Stream the next message; the time to the first content token, and the usage."""
    body = {
        "model": "gemma3", "messages": [*messages, {"role": "user", "content": question}], "stream": True,
        "max_tokens": 8, "temperature": 0, "seed": 1, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    text = ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text += piece
            usage = event.get("usage") or usage
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached, "text": text}


async def run(models: Path, *, pairs: int, threads: int) -> dict[str, Any]:
    """The whole measurement; the saved slots live in a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="trioshed-bench-kv-") as kv:
        return await _run(models, Path(kv), pairs=pairs, threads=threads)


async def _run(models: Path, kv: Path, *, pairs: int, threads: int) -> dict[str, Any]:
    import httpx

    from trioshed.testing.server import open_test_server

    messages = history()
    samples: list[dict[str, Any]] = []
    async with (
        open_test_server(
            models, max_loaded_models=1, num_thread=threads, kv_cache_dir=kv, kv_cache_budget=4096 * MiB,
            context_length=4096, keep_alive=-1,
        ) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=None) as http,
    ):  # fmt: skip
        warm = server.state.warm
        assert warm is not None

        async def swap_out() -> None:
            r = await http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
            assert r.status_code == 200, r.text

        first = await next_message(http, messages, "Question 0. Which river is the longest?")  # cold: builds the slot
        print(f"history: {first['prompt_tokens']} prompt tokens, cold TTFT {first['ttft_s']:.2f} s", file=sys.stderr)
        arms = [("restore", "recompute"), ("recompute", "restore")]
        for i in range(pairs):
            for arm in arms[i % 2]:
                await swap_out()
                files = warm.store.entries()
                size = max((e.size for e in files), default=0)
                if arm == "recompute":
                    for e in files:
                        warm.store.remove(e.name)
                k = len(samples) + 1
                seq = server.scheduler.events.last_seq
                result = await next_message(http, messages, f"Question {100 + k}. What about lake number {k}?")
                loads = [e.seconds for e in server.scheduler.events.after(seq) if e.kind == "ready" and e.model.startswith("gemma3")]
                result.update(arm=arm, pair=i, saved_bytes=size, load_s=loads[0] if loads else None)
                samples.append(result)
                print(f"pair {i} {arm:9s}: TTFT {result['ttft_s']:.3f} s (load {result['load_s'] or 0:.2f} s), cached {result['cached_tokens']}/{result['prompt_tokens']}, saved file {size / MiB:.1f} MiB", file=sys.stderr)
        stats = warm.statistics()
    by_arm = {a: [s["ttft_s"] for s in samples if s["arm"] == a] for a in ("restore", "recompute")}
    med = {a: statistics.median(v) for a, v in by_arm.items()}
    loads = {a: statistics.median(s["load_s"] or 0 for s in samples if s["arm"] == a) for a in by_arm}
    return {
        "history_prompt_tokens": first["prompt_tokens"],
        "threads": threads,
        "pairs": pairs,
        "ttft_median_s": med,
        "ratio_restore_to_recompute": med["restore"] / med["recompute"],
        "gemma_load_median_s": loads,
        "saved_file_bytes": max(s["saved_bytes"] for s in samples),
        "warm_stats": {k: getattr(stats, k) for k in ("saves", "restores", "hits", "misses", "restore_failures", "save_seconds", "restore_seconds")},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", type=Path, default=None, help="folder for the models (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    import trio

    from bench.models import prepare_models
    from trioshed.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="trioshed-bench-models-") as temporary:
        models = args.models or Path(temporary)
        prepare_models(models, tiny=(), gemma=True)
        write_tiny_model(models / "tiny.gguf", name="tiny")
        result = trio.run(lambda: run(models, pairs=args.pairs, threads=args.threads))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
