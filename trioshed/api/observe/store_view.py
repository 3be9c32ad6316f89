"""The status page's list of every model in reach: the store's models with what a person picks
by (size, family, quantisation, context, capabilities) and whether each fits the devices now.

Built for the page's stream (:mod:`trioshed.api.observe.events`) when a page connects and then at most
every :data:`REFRESH` seconds; headers come from :meth:`AppState.metadata` (cached), so a
listing after the first costs a stat per model. At most :data:`LIMIT` models are described.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import trio

from trioshed.api.pipeline.preamble import capabilities_of
from trioshed.api.routes.ollama_models import details_now
from trioshed.api.state import AppState
from trioshed.core.estimate import estimate
from trioshed.core.model import Device, DoesNotFit, Placement
from trioshed.core.placement import capacity, place

log = logging.getLogger(__name__)

LIMIT = 500  # models described; a larger store lists its first ones by name
REFRESH = 30.0  # seconds between two listings for one page


def fit_words(now: Placement | DoesNotFit, alone: Placement | DoesNotFit) -> str:
    """``now``: placed in what is free now; ``alone``: with nothing else loaded."""
    if isinstance(now, Placement):
        return "fits now" + _where(now)
    if isinstance(alone, Placement):
        return "fits after unloading others" + _where(alone)
    return "too large for this machine"


def _where(p: Placement) -> str:
    if not p.devices:
        return " (CPU)"
    return f" ({', '.join(p.devices)}" + (f", {p.n_gpu_layers} layers" if p.ram and p.vram_total else "") + ")"


async def store_models(st: AppState) -> list[dict[str, Any]]:
    """Every model of the store (up to :data:`LIMIT`), described; loaded ones say so."""
    specs = await trio.to_thread.run_sync(st.store.list)
    stats = st.scheduler.statistics()
    loaded = {r.model for r in stats.runners}
    source = st.scheduler.devices
    gpus = source.poll()
    system = source.system()
    used: dict[str, int] = {}
    for r in stats.runners:
        for device, nbytes in r.usage:
            used[device] = used.get(device, 0) + nbytes
    free_gpus: list[Device] = []
    for gpu in gpus:  # reported free memory where the device reports it, else trioshed's accounting
        free = gpu.free if source.kind.startswith("nvml") else max(0, gpu.total - used.get(gpu.id, 0))
        free_gpus.append(replace(gpu, free=free))
    overhead = st.settings.gpu_overhead
    out = []
    for spec in specs[:LIMIT]:
        entry: dict[str, Any] = {"name": spec.name, "size": spec.size, "loaded": spec.name in loaded}
        try:
            meta = await st.metadata(spec)
            facts = await trio.to_thread.run_sync(details_now, spec)
            options = st.runner_options(spec, {})
            est = estimate(meta, options, max_tensor=source.max_tensor)
            now = place(est, free_gpus, system_free=system.free, overhead=overhead)
            alone = capacity(est, gpus, system_total=system.total, overhead=overhead)
            entry.update({
                "family": facts.get("family") or "", "parameters": facts.get("parameter_size") or "",
                "quantization": facts.get("quantization_level") or "", "context_length": meta.context_length,
                "num_ctx": options.num_ctx, "capabilities": capabilities_of(spec, meta),
                "chat_template": bool(meta.chat_template),  # without one: a base model, which continues text
                "estimate": est.total, "prompt_cache": options.cache_ram_mib * 1024 * 1024,
                "fit": fit_words(now, alone), "fits_now": isinstance(now, Placement),
            })  # fmt: skip
        except Exception as exc:  # a broken file still lists, with what is wrong
            log.debug("status page: cannot describe %s: %s", spec.name, exc)
            entry.update({"error": "cannot read this model's file"})
        out.append(entry)
    return out
