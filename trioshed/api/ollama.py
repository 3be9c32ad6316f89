"""Ollama's API: /api/generate, /api/chat, /api/ps, /api/tags, /api/show, /api/version, GET /.

Statuses are decided before the response starts (Quart sends headers before it enters the
body): unknown model 404, bad input 400, queue full 503, cannot fit 507, load failure 500.
Errors after the first streamed chunk arrive as a final NDJSON ``{"error": ...}`` line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import trio
from quart import Blueprint, Response, current_app, request

from trioshed import __version__
from trioshed.api import translate
from trioshed.api.limits import check_body_fields, check_unicode
from trioshed.api.state import AppState
from trioshed.api.upstream import leased_stream, open_upstream, post_upstream, truncated
from trioshed.config import parse_duration
from trioshed.core.estimate import effective_kv_type
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import BadRequest, TrioshedError
from trioshed.models.capabilities import capabilities
from trioshed.models.ollama_store import OllamaManifest
from trioshed.scheduler import Lease, RunnerStats
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)
bp = Blueprint("ollama", __name__)

NDJSON = "application/x-ndjson"


def state() -> AppState:
    return current_app.config["TRIOSHED"]  # type: ignore[no-any-return]


async def json_body() -> dict[str, Any]:
    return (await json_body_raw())[1]


async def json_body_raw() -> tuple[bytes, dict[str, Any]]:
    """The request body as sent, and parsed (a JSON object, else BadRequest)."""
    raw = await request.get_data(as_text=False)
    if not raw:
        raise BadRequest("missing request body")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"invalid JSON in request body: {exc}") from None
    except RecursionError:
        raise BadRequest("invalid JSON in request body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    check_body_fields(body)
    check_unicode(raw if isinstance(raw, bytes) else raw.encode(), body)
    return raw if isinstance(raw, bytes) else raw.encode(), body


def keep_alive_of(body: Mapping[str, Any]) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"invalid keep_alive: {exc}") from None


def rfc3339(ts: float) -> str:
    if math.isinf(ts):
        ts = datetime(2318, 1, 1, tzinfo=UTC).timestamp()  # "forever", as Ollama shows it
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def ndjson(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


async def _ollama_stream(
    lease: Lease, upstream: translate.Upstream, stream: translate.OllamaStream, started: float
) -> AsyncIterator[bytes]:
    # Once upstream reported the end, only its usage/timings and the close follow (microseconds
    # later): what is left goes out in one write with the done chunk (one send fewer per answer).
    held = b""
    try:
        async with open_upstream(lease, upstream.path, upstream.body) as batches:
            async for lines in batches:
                out = b"".join(map(ndjson, stream.feed_lines(lines)))
                if stream.finished:
                    held += out
                elif out:
                    yield out
        if not stream.finished:
            raise await truncated(lease)
        last = stream.finish(load_duration_ns=_ns(lease.load_duration), total_duration_ns=_ns(time.monotonic() - started))
        if stream.kind == "generate":
            last["context"] = NO_CONTEXT
        if (trace := current_trace.get()) is not None:
            trace.counted(last)
        yield held + ndjson(last)
    except TrioshedError as exc:
        log.warning("stream for %s ended with an error: %s", lease.model.name, exc.message)
        yield held + ndjson(exc.to_json())


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def _serve(kind: translate.Kind) -> Response:
    st = state()
    started = time.monotonic()
    body = await json_body()
    model = st.store.resolve(body.get("model") or "")
    keep_alive = keep_alive_of(body)
    defaults = {k: v for k, v in model.defaults}
    sampling_overrides = body.get("options")
    if sampling_overrides is not None and not isinstance(sampling_overrides, dict):
        raise BadRequest("options must be an object")
    _, runner_overrides = translate.split_options({**defaults, **(sampling_overrides or {})})
    options = st.runner_options(model, runner_overrides)

    if translate.is_load_only(kind, body):
        reason: Literal["load", "unload"] = "load"
        if keep_alive == 0:
            await st.scheduler.unload(model)
            reason = "unload"
        else:
            async with st.scheduler.acquire(model, options, keep_alive):
                pass
        return Response(
            json.dumps(translate.load_response(kind, model.name, done_reason=reason, created_at=translate.now_rfc3339())),
            content_type="application/json",
        )

    body = with_model_system(kind, body, model.system)
    templated = await has_chat_template(model)
    if kind == "generate":
        # A model without a chat template gets the prompt as it is (Ollama's default template
        # "{{ .Prompt }}"); llama-server would otherwise wrap it in ChatML.
        upstream = translate.generate_upstream(body, chat_template=templated)
    elif templated:
        upstream = translate.chat_upstream(body)
    else:
        upstream = transcript_upstream(body)
    if defaults:
        upstream = upstream.with_defaults(translate.split_options(defaults)[0])
    translator = translate.OllamaStream(kind, model.name, prefill=upstream.prefill)

    if body.get("stream", True) is False:
        # One JSON answer upstream too: llama-server sends no per-token events to parse.
        whole = {k: v for k, v in upstream.body.items() if k != "stream_options"} | {"stream": False}
        async with st.scheduler.acquire(model, options, keep_alive) as lease:
            translator.feed(await post_upstream(lease, upstream.path, whole))
            if not translator.finished:
                raise await truncated(lease)
            result = translator.aggregate(
                load_duration_ns=_ns(lease.load_duration), total_duration_ns=_ns(time.monotonic() - started)
            )
        if kind == "generate":
            result["context"] = NO_CONTEXT
        if (trace := current_trace.get()) is not None:
            trace.counted(result)
        return Response(json.dumps(result, ensure_ascii=False), content_type="application/json")

    return await leased_stream(
        st.scheduler, model, options, keep_alive,
        lambda lease: _ollama_stream(lease, upstream, translator, started), NDJSON,
    )  # fmt: skip


@bp.post("/api/generate")
async def generate() -> Response:
    return await _serve("generate")


@bp.post("/api/chat")
async def chat() -> Response:
    return await _serve("chat")


#: Ollama's last /api/generate answer carries ``context``, the conversation's token ids, which a
#: client may send back to continue (deprecated in Ollama's API). trioshed keeps no token history
#: outside raw mode, so its ``context`` is empty; clients that validate the answer (the Vercel AI
#: SDK's ollama-ai-provider-v2 requires the field) accept it, and sending it back is harmless.
NO_CONTEXT: list[int] = []


def with_model_system(kind: translate.Kind, body: dict[str, Any], system: str) -> dict[str, Any]:
    """``body`` with the model's default system prompt (an Ollama store's ``system`` layer) where
    the request brings none, as Ollama does: ``system`` for generate, a leading system message
    for chat."""
    if not system:
        return body
    if kind == "generate":
        return body if body.get("system") else {**body, "system": system}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return body
    first = messages[0]
    if isinstance(first, dict) and first.get("role") == "system":
        return body
    return {**body, "messages": [{"role": "system", "content": system}, *messages]}


#: Where a transcript's answer ends: the next turn (see :func:`transcript_prompt`).
TURN_STOP = "\nUser:"


def transcript_prompt(messages: list[dict[str, Any]]) -> str:
    """A conversation as a plain transcript a base model can continue ("User: …", then
    "Assistant:"); a message's content is its text (OpenAI's text parts joined)."""
    lines = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if isinstance(content, list):  # OpenAI's content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role == "system":
            lines.append(f"{content}\n")
        elif role in ("user", "tool"):
            lines.append(f"User: {content}")
        else:
            lines.append(f"Assistant: {content}")
    return "\n".join(lines) + "\nAssistant:"


def with_turn_stop(stop: object) -> list[Any]:
    """The client's stop strings (one or a list) and the transcript's next turn."""
    given = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
    return [*given, TURN_STOP]


def transcript_upstream(body: dict[str, Any]) -> translate.Upstream:
    """Chat with a model that brings no chat template (a base model, like the demo's): a plain
    transcript it can continue, cut at the next turn. ChatML, llama-server's fallback, makes such
    a model echo markup ("<|im_end|>")."""
    translate.chat_upstream(body)  # the same validation as templated chat
    prompt = transcript_prompt(body.get("messages") or [])
    options = dict(body.get("options") or {})
    options["stop"] = with_turn_stop(options.get("stop"))
    raw = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    return translate.generate_upstream({**raw, "prompt": prompt, "raw": True, "options": options})


async def has_chat_template(spec: ModelSpec) -> bool:
    try:
        meta = await state().metadata(spec)
    except Exception:
        return True  # let llama-server decide
    return bool(meta.chat_template)


async def details(spec: ModelSpec) -> dict[str, Any]:
    from trioshed.models.gguf_meta import read_metadata

    try:
        meta = await trio.to_thread.run_sync(read_metadata, spec.path)
    except Exception as exc:  # a broken file still lists, with what is known
        log.warning("cannot read metadata of %s: %s", spec.path, exc)
        return {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}
    arch = meta.architecture or ""
    out = {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": _human_params(meta.parameter_count),
        "quantization_level": meta.quantization or "",
    }
    origin = spec.origin
    if isinstance(origin, OllamaManifest):  # what the manifest's config says, as Ollama lists it
        out["family"] = origin.family or out["family"]
        out["families"] = list(origin.families) or out["families"]
        out["parameter_size"] = origin.parameter_size or out["parameter_size"]
        out["quantization_level"] = origin.quantization_level or out["quantization_level"]
    return out


def _human_params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


@bp.get("/api/tags")
async def tags() -> Any:
    st = state()
    models = []
    for spec in await trio.to_thread.run_sync(st.store.list):
        models.append(
            {
                "name": spec.name,
                "model": spec.name,
                "modified_at": rfc3339(spec.modified),
                "size": spec.size,
                "digest": await st.digest(spec),
                "details": await details(spec),
            }
        )
    return {"models": models}


@bp.get("/api/ps")
async def ps() -> Any:
    st = state()
    out = []
    stats = st.scheduler.statistics()
    for r in stats.runners:
        spec = st.store.resolve(r.model) if _resolvable(st, r.model) else None
        entry = {
            "name": r.model,
            "model": r.model,
            "size": r.size,
            "size_vram": r.size_vram,
            "digest": (await st.digest(spec)) if spec else "",
            "details": (await details(spec)) if spec else {},
            "expires_at": rfc3339(r.expires_at),
            "context_length": r.context_length,
            "runner": await _runner_settings(st, r.options, spec, r),
        }
        if r.placement.endpoints:  # trioshed's addition: the RPC servers holding some layers
            entry["rpc_servers"] = list(r.placement.endpoints)
        out.append(entry)
    if not stats.remote:
        return {"models": out}
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
    return {"models": out, "rpc_servers": servers}


async def _runner_settings(
    st: AppState, options: RunnerOptions, spec: ModelSpec | None, stats: RunnerStats | None = None
) -> dict[str, Any]:
    """The llama-server settings a runner has (or would have): what its size depends on.

    ``num_ctx`` is per slot, as in Ollama; llama-server gets ``--ctx-size`` = ``kv_cells`` =
    ``num_ctx * num_parallel`` (its ``-c`` is shared by the slots). ``flash_attention`` is
    TRIOSHED_FLASH_ATTENTION (off by default; llama-server's own default, ``auto``, turns it on
    where supported, which shrinks the compute buffer). ``size_source`` says whether ``size``
    is what llama.cpp reported allocating (``measured``, the sum of its buffers) or the estimate.
    """
    kv_type = options.kv_cache_type
    if spec is not None:
        try:
            kv_type = effective_kv_type(options, await st.metadata(spec))
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
    }
    if stats is not None:
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
    return out


def _resolvable(st: AppState, name: str) -> bool:
    try:
        st.store.resolve(name)
    except TrioshedError:
        return False
    return True


@bp.post("/api/show")
async def show() -> Any:
    from trioshed.core.estimate import estimate
    from trioshed.models.gguf_meta import read_metadata

    st = state()
    body = await json_body()
    spec = st.store.resolve(body.get("model") or body.get("name") or "")
    meta = await trio.to_thread.run_sync(read_metadata, spec.path)
    options = st.runner_options(spec, {})
    est = estimate(meta, options)
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
            "trioshed.estimate.total": est.total,
        }
    )
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
        "capabilities": capabilities(meta.fields, template, projector=bool(spec.projector), family=facts["family"]),
        "modified_at": rfc3339(spec.modified),
    }
    if spec.system:
        out["system"] = spec.system
    if origin and origin.license:
        out["license"] = origin.license
    return out


def _parameter_lines(defaults: tuple[tuple[str, object], ...]) -> list[str]:
    """Ollama's ``parameters`` text: ``name value`` per line, a list one line per item."""
    lines = []
    for key, value in defaults:
        for item in value if isinstance(value, list | tuple) else [value]:
            lines.append(f"{key:<30} {json.dumps(item, ensure_ascii=False)}")
    return lines


def _modelfile(spec: ModelSpec, template: str) -> str:
    lines = [f"# Modelfile of {spec.name} as trioshed serves it", f"FROM {spec.path}"]
    lines += [f"ADAPTER {a}" for a in spec.adapters]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    if spec.system:
        lines.append(f'SYSTEM """{spec.system}"""')
    lines += [f"PARAMETER {line}" for line in _parameter_lines(spec.defaults)]
    return "\n".join(lines) + "\n"


@bp.get("/api/version")
async def version() -> Any:
    return {"version": __version__}


@bp.route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    return Response("Ollama is running", content_type="text/plain; charset=utf-8")
