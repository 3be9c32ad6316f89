"""How an embedding or rerank runner is started (pure): the model's own pooling, a micro-batch of
the whole context, ``--rerank`` for a reranker, and the capability each kind of model shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioshed.core.estimate_compute import compute_buffer
from trioshed.core.estimate_kv import batch_sizes
from trioshed.core.model import ModelSpec, Placement, RunnerOptions
from trioshed.models.capabilities import capabilities, is_reranker, pooling_type
from trioshed.models.gguf_meta import read_metadata
from trioshed.runner.command import build_command, embedding_flags
from trioshed.testing.tiny import write_tiny_model


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pooled")
    return {
        "none": write_tiny_model(folder / "plain.gguf"),
        "mean": write_tiny_model(folder / "mean.gguf", pooling_type=1),
        "cls": write_tiny_model(folder / "cls.gguf", pooling_type=2),
        "last": write_tiny_model(folder / "last.gguf", pooling_type=3),
        "rank": write_tiny_model(folder / "rank.gguf", pooling_type=4),
    }


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("none", ["--pooling", "mean"]),  # a generating model: mean, as before
        ("mean", []),
        ("cls", []),  # the GGUF's CLS pooling, never overridden
        ("last", []),
        ("rank", ["--rerank"]),
    ],
)
def test_the_models_own_pooling_is_used(pooled: dict[str, Path], kind: str, flags: list[str]) -> None:
    meta = read_metadata(pooled[kind])
    opts = RunnerOptions(num_ctx=4096, embedding=True)
    assert embedding_flags(opts, meta) == ["--embeddings", "--ubatch-size", "4096", *flags]
    assert embedding_flags(RunnerOptions(), meta) == []  # a chat runner: none of it
    argv = build_command("/bin/llama-server", ModelSpec("m", str(pooled[kind])), opts, Placement(n_gpu_layers=0), port=1, meta=meta)
    assert argv[argv.index("--batch-size") + 1] == "4096"
    assert argv.count("--pooling") == (1 if kind == "none" else 0)


def test_batch_sizes_hold_one_whole_input() -> None:
    assert batch_sizes(RunnerOptions(num_ctx=8192, num_batch=512)) == (512, 512)  # generating
    assert batch_sizes(RunnerOptions(num_ctx=8192, num_batch=256)) == (256, 256)
    assert batch_sizes(RunnerOptions(num_ctx=4096, num_batch=512, embedding=True)) == (4096, 4096)
    assert batch_sizes(RunnerOptions(num_ctx=256, num_batch=512, embedding=True)) == (512, 512)


def test_the_estimate_counts_the_larger_micro_batch(pooled: dict[str, Path]) -> None:
    meta = read_metadata(pooled["cls"])
    chat = compute_buffer(meta, RunnerOptions(num_ctx=4096))
    embed = compute_buffer(meta, RunnerOptions(num_ctx=4096, embedding=True))
    # 8x the micro-batch: the score matrix alone (4 heads x 4096 x 4096 x f32) is 256 MiB
    assert embed > chat + 4 * 4096 * 4096 * 4 - 1


def test_rerankers_and_embedders_are_recognised(pooled: dict[str, Path]) -> None:
    kinds = {}
    for kind, path in pooled.items():
        meta = read_metadata(path)
        kinds[kind] = capabilities(meta.fields, "", tensor_names=[t.name for t in meta.tensors])
    assert kinds == {
        "none": ["completion"],
        "mean": ["embedding"],
        "cls": ["embedding"],
        "last": ["embedding"],
        "rank": ["rerank"],
    }
    bert = {"general.architecture": "bert", "bert.pooling_type": 2}
    assert pooling_type(bert) == 2
    assert not is_reranker(bert, ["blk.0.attn_q.weight"])
    assert is_reranker(bert, ["blk.0.attn_q.weight", "cls.output.weight"])  # a classifier head
