"""Speculative decoding: which kind a runner uses, and the llama-server flags for it (pure).

llama-server b10068 verifies drafted tokens against the model itself, so at temperature 0 the
tokens are those of plain decoding; only the speed changes. Two sources of drafts:

* **n-gram** (``--spec-type ngram-*``): drafts from the tokens already in the context (the
  prompt and the answer so far). No second model, no memory worth counting; it pays when the
  answer repeats its context (code edited or repeated, quoted documents, JSON with repeated
  keys) and costs a little where nothing repeats.
* **a draft model** (``--model-draft``, ``--spec-type draft-simple``): a small model with the
  same vocabulary; its weights, KV cache and compute buffer are counted with the target's
  (:mod:`trioshed.core.estimate`).

A setting (``TRIOSHED_SPECULATION``, ``models.toml``'s ``speculation``) is ``"off"``,
``"ngram"`` (the n-gram kind and parameters chosen by measurement, :data:`NGRAM`) or one of
llama.cpp's n-gram kinds by name with llama.cpp's defaults (:data:`NGRAM_TYPES`).
"""

from __future__ import annotations

import re

OFF = "off"
#: llama-server b10068's n-gram kinds (``--spec-type``), usable by name.
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: What ``"ngram"`` means: the kind and parameters measured best on Gemma 3 270M
#: (bench/speculation.py; docs/benchmarks.md has the table).
NGRAM: tuple[str, ...] = (
    "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "16",
)  # fmt: skip
#: What a speculation setting may say.
CHOICES = (OFF, "ngram", *NGRAM_TYPES)
#: The default. Speculation is on by default only where it never cost more than a few percent on
#: any workload measured; every n-gram kind cost 7-20 % of tokens per CPU-second on free-form text
#: (few repeats: drafts rejected, their verification wasted), so it is off unless asked for.
DEFAULT = "off"


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


def ngram_args(speculation: str) -> list[str]:
    """The ``--spec-*`` flags for an n-gram setting (none for ``"off"``)."""
    if speculation == OFF:
        return []
    if speculation == "ngram":
        return list(NGRAM)
    if speculation in NGRAM_TYPES:
        return ["--spec-type", speculation]
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
