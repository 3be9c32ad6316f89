"""Speculative decoding: which kind a runner uses (pure; llama-server's flags for it are spelled
in :func:`trioshed.runner.command.speculation_args`).

llama-server b10068 verifies drafted tokens against the model itself, so a draft only changes
the speed; at temperature 0 the tokens are those of plain decoding up to rounding: on the CPU a
verification batch goes through other kernels than a single token (for repacked weights, and
for attention without flash attention), which round differently, and where two candidates are
nearly tied the other one can win. Batch-invariant runners
(``RunnerOptions.batch_invariant``: flash attention, weights not repacked) give the same tokens
with speculation as without. Two sources of drafts:

* **n-gram** (``--spec-type ngram-*``): drafts from the tokens already in the context (the
  prompt and the answer so far). No second model, no memory worth counting; it pays when the
  answer repeats its context (code edited or repeated, quoted documents, JSON with repeated
  keys) and costs a little where nothing repeats.
* **a draft model** (``--model-draft``, ``--spec-type draft-simple``): a small model with the
  same vocabulary; its weights, KV cache and compute buffer are counted with the target's
  (:mod:`trioshed.core.estimate`).

A setting (``TRIOSHED_SPECULATION``, ``models.toml``'s ``speculation``) is ``"off"``,
``"ngram"`` (the n-gram kind and parameters chosen by measurement, :data:`MEASURED`) or one of
llama.cpp's n-gram kinds by name with llama.cpp's defaults (:data:`NGRAM_TYPES`).

Why a long lookup: on the CPU a verification batch is not free. Measured on Gemma 3 270M, a
16-token draft's verification cost about 8 single decode steps (half a step per drafted token,
the logits over its 262k-token vocabulary being computed for every drafted position), so a draft
pays only when more than about half of it is accepted. A 12-token lookup drafts only where the
context already holds the same 12 tokens: copied code almost always continues as before (315 of
315 drafted tokens accepted), free text rarely matches at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OFF = "off"
#: llama-server b10068's n-gram kinds (``--spec-type``), usable by name.
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


@dataclass(frozen=True)
class NgramDrafting:
    """An n-gram drafting choice: llama.cpp's kind, and for ``ngram-simple`` the lookup length
    (the tokens that must be found earlier in the context) and the longest draft; None:
    llama.cpp's default."""

    kind: str
    lookup: int | None = None
    draft: int | None = None


#: What ``"ngram"`` means: the kind and parameters measured best on Gemma 3 270M
#: (bench/speculation.py; docs/benchmarks.md has the table): drafts of up to 16 tokens, only
#: after the last 12 tokens are found earlier in the context.
MEASURED = NgramDrafting("ngram-simple", lookup=12, draft=16)
#: What a speculation setting may say.
CHOICES = (OFF, "ngram", *NGRAM_TYPES)
#: The default: on only if no workload measured was more than ~3 % slower with it. Through
#: trioshed on a quiet 2-core machine the 12-token lookup ran copied code at ~1.7x tokens/s and
#: no workload slower than plain, free-form text included (docs/benchmarks.md).
DEFAULT = "ngram"


def parse_speculation(value: object) -> str:
    """A setting's value → one of :data:`CHOICES` (``true``/``false`` read as ``ngram``/``off``).
    Raises ValueError naming the choices."""
    if isinstance(value, bool):
        return "ngram" if value else OFF
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "on", "yes", "1"):
            return "ngram"
        if lowered in ("false", "no", "0", "none", ""):
            return OFF
        if lowered in CHOICES:
            return lowered
    raise ValueError(f"use one of {', '.join(CHOICES)} (got {value!r})")


def ngram_drafting(speculation: str) -> NgramDrafting | None:
    """What an n-gram setting drafts with (None for ``"off"``)."""
    if speculation == OFF:
        return None
    if speculation == "ngram":
        return MEASURED
    if speculation in NGRAM_TYPES:
        return NgramDrafting(speculation)
    raise ValueError(f"unknown speculation {speculation!r}")


_STATS = re.compile(rb'[{,]"draft_n":(\d+),"draft_n_accepted":(\d+)')


def drafted_accepted(tail: bytes) -> tuple[int, int] | None:
    """llama-server's ``timings.draft_n`` and ``draft_n_accepted`` from the end of an answer
    (the final streamed event, or the whole body); None where it reports none (no speculation,
    or nothing drafted). A ``"draft_n"`` inside generated text is escaped (``\\"draft_n\\"``)
    and does not match."""
    found = None
    for found in _STATS.finditer(tail):  # noqa: B007 - the last one is the answer's own
        pass
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2))
