"""LoRA adapter-models on a shared base: which runner serves a model, and what a request selects.

An *adapter-model* is a base GGUF file plus LoRA adapters at scales (a ``models.toml`` entry with
``adapters``, a Modelfile's ``ADAPTER`` lines, an Ollama manifest's adapter layers). The models
of a store whose base is the same file (by identity, not name) and whose runner settings agree
form a *group* (the store works it out: :mod:`trioshed.models.groups`); the base itself is a
member. One runner serves the whole group: it loads the base and every adapter of the group, in
a stable order (``ModelSpec.group``), and each request selects its model's adapters with
llama-server's per-request ``lora`` list. A group of a base and four fine-tunes is one load,
not four swaps.

What llama-server b10068 does, as measured against the binary (the tests say where):

- ``--lora a,b`` loads both, ids in that order; a repeated ``--lora`` warns "only last value
  will be used" (it is deprecated), so trioshed always passes one comma-separated list.
- ``lora: [{"id", "scale"}]`` is honoured on ``/completion``, ``/v1/completions``,
  ``/v1/chat/completions`` and ``/infill``; not on its ``/v1/messages``, ``/v1/responses``,
  embeddings or rerank, where the global scales apply.
- No field, or an empty list, means the global scales, which start at 1.0 for every loaded
  adapter (also with ``--lora-init-without-apply``), and keeps the slot's cache whatever
  computed it. So every request sends the whole list (:func:`lora_field`): its model's adapters
  at their scales, every other at 0; the base's request all at 0. An id absent from the list is
  0; an unknown id is ignored.
- A list that differs from the one the slot last ran clears the slot's cache ("clearing cache
  for lora change"): a prefix computed under one adapter set is never reused under another in
  the same slot. Not so the host-memory prompt cache (``--cache-ram``), matched by tokens only: a
  prefix computed under one adapter was loaded into a slot running another, and the answer
  changed. A runner that selects adapters per request therefore runs without it
  (:func:`selects`, ``core.runner_options``).
- A slot restored from a file keeps its last list (a fresh slot's is empty), and the first
  request with another list clears it: warm returns prime the slot with the request's list
  before the restore, and restore only a file saved under the same adapter set
  (:mod:`trioshed.runner.slots`).
- Requests with different adapter sets are not batched in one decode step: one runner serving
  several sets at once runs them in turns (the price is in ``docs/models.md``).
- No adapter can be added to a running server: a group that grows starts a new runner.

An embedding or rerank request cannot select adapters: its runner loads only its model's own
adapters at their scales (:func:`runner_model` with ``embedding``), a runner of its own.

Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from trioshed.core.model import ModelSpec

__all__ = [
    "LORA_PATHS",
    "adapter_set",
    "group_of",
    "lora_field",
    "own_only",
    "runner_model",
    "scales_of",
    "selects",
    "serves",
]

#: llama-server's paths that honour a request's ``lora`` list (b10068).
LORA_PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions", "/infill"})


def scales_of(spec: ModelSpec) -> tuple[float, ...]:
    """The scale of each of the model's own adapters (1.0 where none is given)."""
    scales = spec.adapter_scales
    return tuple(float(scales[i]) if i < len(scales) else 1.0 for i in range(len(spec.adapters)))


def adapter_set(spec: ModelSpec) -> tuple[tuple[str, float], ...]:
    """What a request for ``spec`` applies: each adapter file with its summed scale, sorted, no
    zero scale (the base: empty). Two models with the same set give the same answers; a saved
    slot is keyed by it, and the scheduler queues by it."""
    summed: dict[str, float] = {}
    for path, scale in zip(spec.adapters, scales_of(spec), strict=True):
        summed[path] = summed.get(path, 0.0) + scale
    return tuple(sorted((p, s) for p, s in summed.items() if s != 0.0))


def group_of(spec: ModelSpec) -> tuple[str, ...]:
    """The adapters a runner for ``spec`` loads to serve its whole group: the store's group,
    then any of the model's own the store did not know of yet (a model created a moment ago)."""
    if not spec.group:
        return tuple(dict.fromkeys(spec.adapters))
    known = set(spec.group)
    return spec.group + tuple(dict.fromkeys(a for a in spec.adapters if a not in known))


def runner_model(spec: ModelSpec, *, embedding: bool = False) -> ModelSpec:
    """The spec of the runner that serves a request for ``spec``.

    A generating request: the base with every adapter of its group loaded (``adapters`` and
    ``group`` both the group, no fixed scales: each request selects). An embedding or rerank
    request, which cannot select: the model's own adapters at its scales, fixed (``group`` empty).
    A model with no adapters and no group: itself. Idempotent."""
    if embedding:
        return spec if not spec.group else replace(spec, group=())
    group = group_of(spec)
    if not group:
        return spec
    if spec.adapters == group and spec.group == group and not spec.adapter_scales:
        return spec
    return replace(spec, adapters=group, adapter_scales=(), group=group)


def own_only(spec: ModelSpec, *, embedding: bool = False) -> ModelSpec | None:
    """``spec`` without its group, where its group's runner holds other models' adapters too
    (a runner of its own adapters only is then smaller: the plan's choice under memory pressure
    and for a hot adapter set); None where it would be the same runner."""
    if embedding or not spec.group:
        return None
    alone = replace(spec, group=())
    return alone if runner_model(alone).adapters != runner_model(spec).adapters else None


def selects(runner: ModelSpec) -> bool:
    """Whether a runner of ``runner`` (a :func:`runner_model`) selects adapters per request:
    then every request to it carries a ``lora`` list, and it keeps no host-memory prompt cache."""
    return bool(runner.group)


def serves(runner: ModelSpec, spec: ModelSpec, *, embedding: bool = False) -> bool:
    """Whether a runner started from ``runner`` applies ``spec``'s adapters as ``spec`` asks (the
    base file and the rest are compared by ``core.views.same_files``).

    A generating request selects (:func:`lora_field`): the runner must hold its adapters. An
    embedding request cannot: the runner's fixed adapters must be exactly its own."""
    if embedding:
        return not runner.group and adapter_set(runner) == adapter_set(spec)
    if not spec.adapters:
        return True
    held = set(runner.adapters)
    return all(a in held for a in spec.adapters)


def lora_field(runner: ModelSpec, spec: ModelSpec) -> list[dict[str, Any]] | None:
    """The ``lora`` list of a request for ``spec`` on a runner of ``runner``: every adapter the
    runner loaded, by its id (its place in ``--lora``), at ``spec``'s scale for it, 0 for the
    others. None when the runner loaded none (nothing to select). Raises ValueError when the
    runner lacks one of ``spec``'s adapters (``serves`` said so before it was leased)."""
    if not runner.adapters:
        return None
    wanted = dict(adapter_set(spec))
    missing = set(wanted) - set(runner.adapters)
    if missing:
        raise ValueError(f"the runner of {runner.name} does not hold the adapters of {spec.name}")
    seen: set[str] = set()
    out = []
    for i, path in enumerate(runner.adapters):
        scale = wanted.get(path, 0.0) if path not in seen else 0.0  # a file listed twice: once
        seen.add(path)
        out.append({"id": i, "scale": scale})
    return out


def names_with(specs: Iterable[ModelSpec], adapters: Iterable[str]) -> list[str]:
    """The names of ``specs`` whose every adapter is among ``adapters`` (the members a runner
    holding those adapters serves), in the order given."""
    held = set(adapters)
    return [s.name for s in specs if all(a in held for a in s.adapters)]
