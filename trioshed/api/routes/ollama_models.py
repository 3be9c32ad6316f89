"""Ollama's model routes: /api/tags, /api/ps, /api/show, /api/version, GET /."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import trio
from quart import Blueprint, Response, request

from trioshed import OLLAMA_API_VERSION, __version__
from trioshed.api.pipeline.preamble import model_capabilities, read_body, resolve, state
from trioshed.api.state import AppState
from trioshed.core.estimate import estimate
from trioshed.core.estimate_kv import effective_kv_type
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.core.projector import projector_info, projector_memory
from trioshed.fleet import view as fleet_view
from trioshed.keys import current_key
from trioshed.models import modelfile
from trioshed.models.gguf_meta import GGUFMetadata, read_metadata, unreadable
from trioshed.models.header_cache import header_of, listing_facts
from trioshed.models.ollama_store import OllamaManifest
from trioshed.scheduler import RunnerStats

log = logging.getLogger(__name__)
bp = Blueprint("ollama_models", __name__)


_FOREVER = datetime(2318, 1, 1, tzinfo=UTC).timestamp()  # "forever", as Ollama shows it


def rfc3339(ts: float) -> str:
    """A wall-clock time as RFC 3339; anything past 2318 (or not finite) is Ollama's "forever"."""
    if not math.isfinite(ts) or ts >= _FOREVER:
        ts = _FOREVER
    return datetime.fromtimestamp(max(ts, 0.0), UTC).isoformat().replace("+00:00", "Z")


_NO_DETAILS = {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}


def details_now(spec: ModelSpec) -> dict[str, Any]:
    """A model's ``details`` as Ollama lists them. Blocking (a stat; the header on a miss): call
    it in a worker thread. A broken or vanished file still lists, with what is known."""
    try:
        arch, params, quant = listing_facts(spec.path)
    except Exception as exc:
        log.warning("cannot read metadata of model '%s': %s", spec.name, exc)
        return dict(_NO_DETAILS)
    out = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
           "parameter_size": params, "quantization_level": quant}  # fmt: skip
    origin = spec.origin
    if isinstance(origin, OllamaManifest):  # what the manifest's config says, as Ollama lists it
        out["family"] = origin.family or out["family"]
        out["families"] = list(origin.families) or out["families"]
        out["parameter_size"] = origin.parameter_size or out["parameter_size"]
        out["quantization_level"] = origin.quantization_level or out["quantization_level"]
    return out


async def details(spec: ModelSpec) -> dict[str, Any]:
    return await trio.to_thread.run_sync(details_now, spec)


def _digest_now(st: AppState, spec: ModelSpec) -> str:
    """The model's digest (blocking: hashes the file the first time), "" if it cannot be read."""
    try:
        return st.store.digest(spec)
    except OSError as exc:
        log.warning("cannot hash model '%s': %s", spec.name, exc)
        return ""


@bp.get("/api/tags")
async def tags() -> Any:
    st = state()
    key = current_key.get()  # a key sees only the models it may use

    def listing() -> list[dict[str, Any]]:  # one worker thread for the whole store's stats and reads
        return [
            {"name": spec.name, "model": spec.name, "modified_at": rfc3339(spec.modified), "size": spec.size,
             "digest": _digest_now(st, spec), "details": details_now(spec)}
            for spec in st.store.list() if key.may_use(spec.name)
        ]  # fmt: skip

    models = await trio.to_thread.run_sync(listing)
    if st.fleet is not None:  # the fleet's models: those only other nodes hold, with where
        here = {m["name"] for m in models}
        for name, (size, nodes) in sorted(fleet_view.models_elsewhere(st.fleet, here).items()):
            if key.may_use(name):
                models.append({"name": name, "model": name, "size": size, "digest": "", "details": {}, "nodes": nodes})
    return {"models": models}


@bp.get("/api/ps")
async def ps() -> Any:
    st = state()
    stats = st.scheduler.statistics()  # a snapshot, taken on the Trio thread

    def entry(r: RunnerStats) -> dict[str, Any]:  # blocking: stats, and hashing a file the first time
        out: dict[str, Any] = {"name": r.model, "model": r.model, "size": r.size, "size_vram": r.size_vram}
        spec = r.spec
        try:
            out.update({
                "digest": _digest_now(st, spec) if spec else "",
                "details": details_now(spec) if spec else {},
                "expires_at": rfc3339(r.expires_at),
                "context_length": r.context_length,
                "runner": _runner_settings_now(st, r.options, spec, r),
            })  # fmt: skip
        except Exception:  # one runner's state never breaks the listing: it shows what is known
            log.exception("/api/ps: cannot describe the runner of %s", r.model)
        if r.placement.endpoints:  # trioshed's addition: the RPC servers holding some layers
            out["rpc_servers"] = list(r.placement.endpoints)
        return out

    def rows(r: RunnerStats) -> list[dict[str, Any]]:
        """A runner's rows: one per warm model of an adapter group (its size on the first)."""
        members = [m for m in r.members if key.may_use(m.name)]
        if len(r.members) <= 1 or not r.adapters:
            return [entry(r)] if key.may_use(r.model) else []
        out = []
        for i, m in enumerate(members):
            row = entry(replace(r, model=m.name, spec=m.spec or r.spec, expires_at=m.expires_at))
            if i:
                row.update(size=0, size_vram=0)
                if isinstance(row.get("runner"), dict):
                    row["runner"]["shared_with"] = members[0].name
            out.append(row)
        return out

    key = current_key.get()
    out = await trio.to_thread.run_sync(lambda: [row for r in stats.runners for row in rows(r)])
    body: dict[str, Any] = {"models": out}
    store = st.usage.statistics() if st.usage is not None and key.admin else None
    if store is not None and (store.kind != "sqlite" or not store.reachable):
        body["database"] = store.as_json()  # trioshed's addition, admin only: a team's store, or any store at fault
    if st.fleet is not None and key.admin:  # every node of the fleet: admin only
        body["nodes"] = fleet_view.nodes(st.fleet, trio.current_time())
    if not stats.remote or not key.admin:  # which RPC server holds which model: admin only
        return body
    servers = [
        {
            "address": s.address,
            "state": "up" if s.up else "down",
            "reason": s.reason,
            "total": s.total,
            "free": s.free,
            "memory": s.source,
            "model": s.model,
            "used": s.used,
        }
        for s in stats.remote
    ]
    return {**body, "rpc_servers": servers}


async def _runner_settings(
    st: AppState, options: RunnerOptions, spec: ModelSpec | None, stats: RunnerStats | None = None
) -> dict[str, Any]:
    return await trio.to_thread.run_sync(_runner_settings_now, st, options, spec, stats)


def _runner_settings_now(
    st: AppState, options: RunnerOptions, spec: ModelSpec | None, stats: RunnerStats | None = None
) -> dict[str, Any]:
    """The llama-server settings a runner has (or would have): what its size depends on.

    ``num_ctx`` is per slot, as in Ollama; llama-server gets ``--ctx-size`` = ``kv_cells`` =
    ``num_ctx * num_parallel`` (its ``-c`` is shared by the slots). ``flash_attention`` is
    TRIOSHED_FLASH_ATTENTION, automatic by default (on where every backend has the kernel, as
    llama-server's own ``auto`` decides; it shrinks the compute buffer). ``cache_ram`` is the bytes llama-server
    may keep in its host-memory prompt cache (TRIOSHED_CACHE_RAM, counted in the estimate);
    ``swa_full`` whether sliding-window layers keep a full cache (warm returns). ``size_source`` says whether ``size``
    is what llama.cpp reported allocating (``measured``, the sum of its buffers) or the estimate.
    """
    kv_type = options.kv_cache_type
    try:
        kv_type = effective_kv_type(options)
        if spec is not None and kv_type not in ("f16", "f32", "bf16"):  # the header decides only then
            kv_type = effective_kv_type(options, header_of(spec))
    except (OSError, ValueError):
        pass
    out: dict[str, Any] = {
        "num_ctx": options.num_ctx,
        "num_parallel": options.num_parallel,
        "kv_cells": options.kv_cells,
        "num_batch": options.num_batch,
        "flash_attention": options.flash_attention,
        "kv_cache_type": kv_type,
        "embedding": options.embedding,
        # llama-server's host-memory prompt cache (--cache-ram), counted in the estimate
        "cache_ram": options.cache_ram_mib * 1024 * 1024,
        "swa_full": options.swa_full,
        # speculative decoding: off, an n-gram kind, or "draft" (a draft model, named)
        "speculation": "draft" if options.draft else options.speculation,
    }
    if spec is not None and spec.draft and options.draft:
        out["draft"] = spec.draft
    if stats is not None:
        if options.draft or options.speculation != "off":
            out["speculation_stats"] = {"drafted": stats.drafted, "accepted": stats.accepted}
        measured = stats.measured
        out["n_gpu_layers"] = stats.placement.n_gpu_layers
        out["devices"] = list(stats.placement.devices)
        out["size_source"] = "measured" if measured is not None and measured.total > 0 else "estimate"
        if measured is not None:
            out["measured"] = {
                "weights": measured.weights,
                "kv": measured.kv,
                "compute": sum(measured.compute.values()),
                "output": sum(measured.output.values()),
            }
        out["estimated"] = stats.estimate.total
        if stats.warm_returns:
            out["warm_returns"] = stats.warm_returns
    return out


@bp.post("/api/show")
async def show() -> Any:
    st = state()
    body = await read_body()
    spec = resolve(body.get("model") or body.get("name") or "")
    meta = await st.metadata(spec)
    options = st.runner_options(spec, {})
    projector = await _projector_header(spec)
    projector_bytes = projector_memory(projector, flash_attention=options.flash_attention) if projector else 0
    est = estimate(meta, options, projector_bytes=projector_bytes)
    arch = meta.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.parameter_count": meta.parameter_count,
        "general.file_type": meta.file_type,
    }
    for key, value in meta.fields.items():
        if isinstance(value, int | float | str | bool) and not key.startswith("tokenizer.") and len(str(value)) < 256:
            info[key] = value
    info.update(
        {
            "trioshed.estimate.num_ctx": options.num_ctx,
            "trioshed.estimate.weights": est.weights,
            "trioshed.estimate.kv": est.kv,
            "trioshed.estimate.compute": est.compute_full,
            "trioshed.estimate.output": est.output,
            "trioshed.estimate.token_embd": est.token_embd,
            "trioshed.estimate.projector": est.projector,
            "trioshed.estimate.total": est.total,
        }
    )
    if spec.projector_problem:  # an ambiguous folder: no projector was guessed
        info["trioshed.projector.problem"] = spec.projector_problem
    info.update({f"trioshed.runner.{k}": v for k, v in (await _runner_settings(st, options, spec)).items()})
    origin = spec.origin if isinstance(spec.origin, OllamaManifest) else None
    template = (origin.template if origin else "") or meta.chat_template or ""
    facts = await details(spec)
    out: dict[str, Any] = {
        "modelfile": _modelfile(spec, template),
        "parameters": "\n".join(_parameter_lines(spec.defaults)),
        "template": template,
        "details": facts,
        "model_info": info,
        "capabilities": await model_capabilities(spec) or [],
        "modified_at": rfc3339(spec.modified),
    }
    if projector is not None:
        out["projector_info"] = projector_info(projector)
    if spec.system:
        out["system"] = spec.system
    if origin and origin.license:
        out["license"] = origin.license
    if origin and origin.messages:  # a saved chat, a Modelfile's MESSAGE lines: what a chat continues from
        out["messages"] = [{"role": r, "content": c} for r, c in origin.messages]
    return out


async def _projector_header(spec: ModelSpec) -> GGUFMetadata | None:
    """The header of the model's projector (read in a worker thread), None without one."""
    if not spec.projector:
        return None
    try:
        return await trio.to_thread.run_sync(read_metadata, spec.projector)
    except (OSError, ValueError) as exc:
        raise unreadable(spec.name, spec.projector, exc) from None


def _parameter_lines(defaults: tuple[tuple[str, object], ...]) -> list[str]:
    """Ollama's ``parameters`` text: ``name value`` per line, a list one line per item."""
    return modelfile.parameter_lines(defaults)


def _modelfile(spec: ModelSpec, template: str) -> str:
    """A Modelfile that creates the model again: for a model of an Ollama-layout store its layers
    exactly (``FROM``/``ADAPTER`` name the blob files, which ``/api/create`` reads as digests)."""
    origin = spec.origin if isinstance(spec.origin, OllamaManifest) else None
    if origin is None:
        return modelfile.render(name=spec.name, model=[spec.path, *([spec.projector] if spec.projector else [])],
                                adapters=list(spec.adapters), template=template, system=spec.system,
                                parameters=spec.defaults)  # fmt: skip
    return modelfile.render(
        name=spec.name, model=[spec.path, *([spec.projector] if spec.projector else [])], adapters=list(spec.adapters),
        template=origin.template, system=origin.system, parameters=spec.defaults,
        messages=[{"role": r, "content": c} for r, c in origin.messages], licenses=list(origin.licenses),
        requires=origin.requires,
    )  # fmt: skip


@bp.get("/api/version")
async def version() -> Any:
    """The Ollama API version trioshed serves (what Ollama's clients check), and its own."""
    return {"version": OLLAMA_API_VERSION, "trioshed_version": __version__}


@bp.route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    # Ollama's clients read this exact text; a browser asks for HTML and gets a link to the page
    if request.accept_mimetypes.best_match(["text/plain", "text/html"]) == "text/html":
        return Response(ROOT_HTML, content_type="text/html; charset=utf-8", headers={"Content-Security-Policy": "default-src 'none'"})
    return Response("Ollama is running", content_type="text/plain; charset=utf-8")


ROOT_HTML = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>trioshed</title></head>'
    '<body><p>Ollama is running (this is trioshed). <a href="/ui">Status page</a> · '
    '<a href="/openapi.json">/openapi.json</a> · <a href="/metrics">/metrics</a></p></body></html>'
)

