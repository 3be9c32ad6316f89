"""Indexing a corpus: embeddings through trioshed against the same llama-server run alone.

``python -m bench.embed_index`` (or the ``embed`` group of ``bench.compare``): a seeded corpus of
1,000 chunks of about 300 tokens, sent in requests of 32 through ``/v1/embeddings``, to

- **direct**: ``llama-server`` alone, started with exactly the flags trioshed gives an embedding
  runner (``runner.command.build_command``: ``--embeddings``, the model's own pooling,
  ``--batch-size``/``--ubatch-size`` = the context), and
- **trioshed** over the same model, binary, threads and slots (its runner started by itself).

Blocks alternate (direct, trioshed, direct, trioshed, ...) so that both see the same machine;
each block indexes the whole corpus with ``concurrency`` requests in flight. Reported: chunks/s
and tokens/s (wall), and the process CPU seconds of each server's whole tree per 1,000 chunks
(trioshed's includes its llama-server child). Target: trioshed's chunks/s at least 0.95 x
direct's.

Also the memory the larger micro-batch costs (an embedding runner's ``--ubatch-size`` is its
context, a generating runner's 512): ``core.estimate``'s compute buffer for both, per model size
and context, next to llama.cpp's own report for the bench model (``-v`` buffer sizes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench.procs import RunnerFlags, free_port, llama_server_binary, open_server, open_trioshed

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MiB = 1024 * 1024
CHUNKS = 1000
CHUNK_TOKENS = 300
BATCH = 32
TARGET_RATIO = 0.95
#: The bench model: a tiny CLS-pooled GGUF, wide enough that the runner's work dominates.
SHAPE = {"n_embd": 128, "n_layer": 2, "n_head": 4, "pooling_type": 2, "context_length": 2048}
#: Model sizes for the micro-batch's memory (tiny geometries; gemma3-270m when installed).
SIZES = {"tiny 64x2": {"n_embd": 64, "n_layer": 2}, "tiny 256x4": {"n_embd": 256, "n_layer": 4},
         "tiny 1024x8": {"n_embd": 1024, "n_layer": 8, "n_head": 16}}  # fmt: skip
CONTEXTS = (512, 2048, 8192)


def corpus(n: int = CHUNKS, seed: int = 7) -> list[str]:
    """``n`` chunks of about ``CHUNK_TOKENS`` tokens of the tiny model's character tokenizer."""
    rng = random.Random(seed)
    words = ["index", "vector", "query", "chunk", "corpus", "rank", "model", "token", "embed", "search",
             "alpha", "brown", "quiet", "zebra", "graze", "lazy", "seven", "river", "stone", "light"]  # fmt: skip
    out = []
    for _ in range(n):
        text = ""
        while len(text) < CHUNK_TOKENS - 2:
            text += rng.choice(words) + " "
        out.append(text[: CHUNK_TOKENS - 2])
    return out


def _cpu_seconds(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in (root, *root.children(recursive=True)):
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except psutil.Error:
        return 0.0


async def index_once(client: httpx.AsyncClient, url: str, model: str, chunks: Sequence[str], pid: int,
                     *, concurrency: int) -> dict[str, float]:  # fmt: skip
    """Embed every chunk (requests of ``BATCH``); wall time, tokens and the server tree's CPU."""
    batches = [list(chunks[i : i + BATCH]) for i in range(0, len(chunks), BATCH)]
    tokens = 0
    queue = iter(enumerate(batches))
    results: dict[int, int] = {}

    async def worker() -> None:
        nonlocal tokens
        for i, batch in queue:
            r = await client.post(f"{url}/v1/embeddings", json={"model": model, "input": batch})
            r.raise_for_status()
            body = r.json()
            if len(body["data"]) != len(batch):
                raise RuntimeError(f"{len(body['data'])} vectors for {len(batch)} inputs")
            results[i] = len(body["data"])
            tokens += int(body.get("usage", {}).get("prompt_tokens", 0))

    cpu0 = _cpu_seconds(pid)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds(pid) - cpu0
    n = sum(results.values())
    return {"chunks": n, "tokens": tokens, "wall_s": wall, "chunks_per_s": n / wall, "tokens_per_s": tokens / wall,
            "cpu_s_per_1000": cpu * 1000 / max(1, n)}  # fmt: skip


def direct_argv(model: Path, flags: RunnerFlags, port: int) -> list[str]:
    """llama-server alone with an embedding runner's own flags (built by trioshed's code)."""
    from trioshed.core.model import ModelSpec, Placement, RunnerOptions
    from trioshed.core.runner_options import flash_attention
    from trioshed.models.gguf_meta import read_metadata
    from trioshed.runner.command import build_command

    binary, _ = llama_server_binary()
    opts = RunnerOptions(num_ctx=flags.ctx_per_slot, num_parallel=flags.parallel, num_thread=flags.threads, embedding=True,
                         flash_attention=flash_attention(None))  # trioshed's automatic choice on this machine (CPU)
    return build_command(binary, ModelSpec("embedder", str(model)), opts, Placement(n_gpu_layers=0), port=port,
                         verbose=False, meta=read_metadata(model))  # fmt: skip


def micro_batch_memory(bench_model: Path, flags: RunnerFlags) -> dict[str, Any]:
    """The compute buffer of an embedding runner (micro-batch = context) against a generating
    one's (512), estimated per model size and context; and llama.cpp's report for the bench model."""
    from trioshed.core.estimate_compute import compute_buffer
    from trioshed.core.estimate_kv import batch_sizes
    from trioshed.core.model import RunnerOptions
    from trioshed.models.gguf_meta import read_metadata
    from trioshed.testing.llama import measure_load
    from trioshed.testing.tiny import write_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="trioshed-embed-mem-") as tmp:
        paths = {name: write_tiny_model(Path(tmp) / f"{i}.gguf", pooling_type=2, context_length=max(CONTEXTS), **shape)  # type: ignore[arg-type]
                 for i, (name, shape) in enumerate(SIZES.items())}  # fmt: skip
        try:
            from bench.models import GEMMA  # noqa: F401  (gemma3-270m geometry when installed)
            from tests.support.models import gemma_model_path

            gemma = gemma_model_path()
            if gemma is not None:
                paths["gemma3-270m"] = gemma
        except Exception:
            pass
        for name, path in paths.items():
            meta = read_metadata(path)
            for ctx in CONTEXTS:
                for fa in (False, True):
                    chat = RunnerOptions(num_ctx=ctx, flash_attention=fa)
                    embd = replace(chat, embedding=True)
                    rows.append({"model": name, "ctx": ctx, "flash_attention": fa, "ubatch": batch_sizes(embd)[1],
                                 "chat_mib": round(compute_buffer(meta, chat) / MiB, 2),
                                 "embedding_mib": round(compute_buffer(meta, embd) / MiB, 2)})  # fmt: skip
    opts = RunnerOptions(num_ctx=flags.ctx_per_slot, num_parallel=flags.parallel, embedding=True)
    argv = direct_argv(bench_model, flags, 0)
    args: list[str] = []
    skip = False
    for a in argv[1:]:  # measure_load names the model, host and port itself
        if skip or a in ("--model", "--host", "--port"):
            skip = not skip
            continue
        args.append(a)
    report = measure_load(bench_model, args, timeout=120)
    measured = sum(report.memory.compute.values()) / MiB if report.memory else None
    est = compute_buffer(read_metadata(bench_model), opts) / MiB
    return {"sizes": rows, "bench_model": {"estimate_mib": round(est, 2), "llama_cpp_mib": round(measured, 2) if measured else None}}


async def run(*, quick: bool = True, say: Callable[[str], None] = print, work: Path | None = None,
              rounds: int | None = None, concurrency: int = 4) -> dict[str, Any]:  # fmt: skip
    from trioshed.testing.tiny import write_tiny_model

    rounds = rounds or (2 if quick else 4)
    flags = RunnerFlags(threads=1, parallel=4, ctx_per_slot=2048)
    own = None if work is not None else tempfile.TemporaryDirectory(prefix="trioshed-embed-bench-")
    folder = work if work is not None else Path(own.name)  # type: ignore[union-attr]
    models = folder / "embed-models"
    models.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(models / "embedder.gguf", **SHAPE)  # type: ignore[arg-type]
    chunks = corpus()
    blocks: dict[str, list[dict[str, float]]] = {"direct": [], "trioshed": []}
    try:
        env = llama_server_binary()[1]
        port = free_port()
        async with (
            open_server("direct:embedder", direct_argv(model, flags, port), env=env, base_url=f"http://127.0.0.1:{port}",
                        ready_path="/health", log_path=folder / "logs" / "embed-direct.log") as direct,
            open_trioshed(models, flags, folder / "logs", max_loaded=1) as trioshed,
            httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client,
        ):  # fmt: skip
            warm = chunks[:BATCH]
            for server in (direct, trioshed):  # load and warm up both
                await index_once(client, server.base_url, "embedder", warm, server.pid, concurrency=1)
            for r in range(rounds):
                order = (("direct", direct), ("trioshed", trioshed)) if r % 2 == 0 else (("trioshed", trioshed), ("direct", direct))
                for name, server in order:
                    block = await index_once(client, server.base_url, "embedder", chunks, server.pid, concurrency=concurrency)
                    blocks[name].append(block)
                    say(f"embed index round {r + 1}/{rounds} {name}: {block['chunks_per_s']:.1f} chunks/s, "
                        f"{block['tokens_per_s']:.0f} tokens/s, {block['cpu_s_per_1000']:.2f} CPU s per 1000 chunks")  # fmt: skip
        memory = await trio.to_thread.run_sync(micro_batch_memory, model, flags)
    finally:
        if own is not None:
            own.cleanup()

    def total(name: str, key: str) -> float:
        rows = blocks[name]
        if key == "cpu_s_per_1000":
            return sum(b[key] for b in rows) / len(rows)
        wall = sum(b["wall_s"] for b in rows)
        return sum(b["chunks" if key == "chunks_per_s" else "tokens"] for b in rows) / wall

    summary = {name: {k: round(total(name, k), 2) for k in ("chunks_per_s", "tokens_per_s", "cpu_s_per_1000")} for name in blocks}
    ratio = summary["trioshed"]["chunks_per_s"] / summary["direct"]["chunks_per_s"]
    return {"corpus": {"chunks": CHUNKS, "tokens_per_chunk": CHUNK_TOKENS, "batch": BATCH, "concurrency": concurrency},
            "model": SHAPE, "flags": {"threads": flags.threads, "parallel": flags.parallel, "ctx_per_slot": flags.ctx_per_slot},
            "blocks": blocks, "summary": summary, "ratio": round(ratio, 3), "target": TARGET_RATIO,
            "met": ratio >= TARGET_RATIO, "memory": memory}  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    s, c = doc["summary"], doc["corpus"]
    out = [
        f"Indexing {c['chunks']} chunks of ~{c['tokens_per_chunk']} tokens, requests of {c['batch']}, "
        f"{c['concurrency']} in flight, through `/v1/embeddings`; model {doc['model']}, flags {doc['flags']}.",
        "",
        "| target | chunks/s | tokens/s | CPU s per 1000 chunks (server tree) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("direct", "trioshed"):
        out.append(f"| {name} | {s[name]['chunks_per_s']} | {s[name]['tokens_per_s']} | {s[name]['cpu_s_per_1000']} |")
    out += ["", f"trioshed / direct chunks/s: **{doc['ratio']}** (target ≥ {doc['target']}: {'met' if doc['met'] else '**not met**'})", ""]
    mem = doc["memory"]
    bm = mem["bench_model"]
    out += [
        f"Compute buffer of the bench model's embedding runner: estimate {bm['estimate_mib']} MiB, llama.cpp {bm['llama_cpp_mib']} MiB.",
        "",
        "What the larger micro-batch costs (compute buffer, estimate; generating runner: micro-batch 512):",
        "",
        "| model | context | flash attention | embedding micro-batch | generating MiB | embedding MiB |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in mem["sizes"]:
        out.append(f"| {r['model']} | {r['ctx']} | {'on' if r['flash_attention'] else 'off'} | {r['ubatch']} | {r['chat_mib']} | {r['embedding_mib']} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.embed_index", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="blocks per target (interleaved)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--out", type=Path, default=None, help="markdown file to write (default: bench/results/<date>-embed-index.md)")
    args = p.parse_args(argv)
    doc = trio.run(lambda: run(rounds=args.rounds, concurrency=args.concurrency))
    text = markdown(doc)
    out = args.out or RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-embed-index.md"
    out.write_text("# Embeddings: indexing a corpus, trioshed vs llama-server alone\n\n" + text + "\n```json\n"
                   + json.dumps({k: v for k, v in doc.items() if k != "blocks"}, indent=1) + "\n```\n")  # fmt: skip
    print(text)
    return 0 if doc["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
