"""What batch-invariant runners cost: prompt and decode speed of one ``llama-server`` with
flash attention off (weights repacked), with flash attention alone (trioshed's automatic choice
on the CPU), and with what ``TRIOSHED_BATCH_INVARIANT`` passes (``--flash-attn on --no-repack``).

Gemma 3 270M, one thread, CPU only; a ~700-token prompt (not cached) and 128 generated tokens
(``ignore_eos``), the three servers up at once and asked in turn, the order rotated per round.
Reported: llama-server's own ``timings`` (prompt and decode tokens per second), medians over
the rounds. Run alone on a quiet machine: ``python -m bench.invariant --out FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from trioshed.testing.llama import running_llama_server

#: llama-server flags as trioshed passes them for one slot on the CPU, then each arm's own.
BASE = ["-t", "1", "--device", "none", "-ngl", "0", "-c", "4096", "-np", "1", "--fit", "off",
        "--batch-size", "512", "--cache-ram", "0"]  # fmt: skip
ARMS = {
    "flash attention off (--flash-attn off, repacked)": ["--flash-attn", "off"],
    "flash attention only (the CPU's default)": ["--flash-attn", "on"],
    "batch-invariant (--flash-attn on --no-repack)": ["--flash-attn", "on", "--no-repack"],
}
_REPO = Path(__file__).resolve().parent.parent
PROMPT = ("<start_of_turn>user\nExplain what this code does.\n\n"
          + (_REPO / "trioshed" / "core" / "placement.py").read_text(encoding="utf-8")[:2500]
          + "<end_of_turn>\n<start_of_turn>model\n")  # fmt: skip


def run(rounds: int, tokens: int) -> dict[str, dict[str, float]]:
    from bench.models import write_gemma

    model = write_gemma(Path(tempfile.mkdtemp(prefix="trioshed-invariant-")) / "gemma3.gguf")
    samples: dict[str, dict[str, list[float]]] = {name: {"prompt": [], "decode": []} for name in ARMS}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(running_llama_server(model, [*BASE, *args], timeout=120)).url
                for name, args in ARMS.items()}  # fmt: skip
        names = list(ARMS)
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "cache_prompt": False,
                        "ignore_eos": True}  # fmt: skip
                t = httpx.post(f"{urls[name]}/completion", json=body, timeout=600).json()["timings"]
                samples[name]["prompt"].append(t["prompt_per_second"])
                samples[name]["decode"].append(t["predicted_per_second"])
                print(f"round {rnd + 1} {name:48} prompt {t['prompt_n']} tokens at {t['prompt_per_second']:6.1f}/s, "
                      f"decode {t['predicted_per_second']:5.1f}/s", flush=True)  # fmt: skip
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def markdown(table: dict[str, dict[str, float]], rounds: int, tokens: int) -> str:
    base = next(iter(table.values()))
    lines = [f"# Batch-invariant runners, {time.strftime('%Y-%m-%d')}", "",
             f"Gemma 3 270M Q4_K_M, llama-server b10068, one thread, CPU only; a ~700-token prompt and "
             f"{tokens} tokens, {rounds} rounds, medians (ratio to flash attention off).", "",
             "| runner flags | prompt tokens/s | decode tokens/s |", "| --- | ---: | ---: |"]  # fmt: skip
    for name, row in table.items():
        lines.append(f"| {name} | {row['prompt']:.1f} ({row['prompt'] / base['prompt']:.2f}x) | "
                     f"{row['decode']:.1f} ({row['decode'] / base['decode']:.2f}x) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write FILE.json and FILE.md")
    args = p.parse_args(argv)
    table = run(args.rounds, args.tokens)
    md = markdown(table, args.rounds, args.tokens)
    print(md)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
        args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
