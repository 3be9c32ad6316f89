"""What every generating or embedding route does before it reaches a runner, in one place.

:func:`read_body` parses the request's JSON; :func:`prepare` resolves the model and reads
``keep_alive`` and ``options`` into the runner options the scheduler leases by (settings, then the
model's defaults, then the request); :func:`require_capabilities` refuses what the model cannot
do (tools, thinking, images, generating with an embedding model) as Ollama does. Routes then build their protocol's upstream request
(``trioshed.api.protocols``) and lease a runner from ``state().scheduler``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from quart import current_app, request

from trioshed.api.pipeline.limits import check_body_fields, check_unicode
from trioshed.api.protocols.options import split_options
from trioshed.api.state import AppState
from trioshed.config_values import parse_duration
from trioshed.core.context import tokens_upper_bound
from trioshed.core.model import ModelSpec, RunnerOptions
from trioshed.errors import BadRequest, Forbidden, ModelNotFound
from trioshed.keys import ANONYMOUS, ApiKey, current_key
from trioshed.models.capabilities import capabilities
from trioshed.models.gguf_meta import GGUFMetadata, read_metadata
from trioshed.models.ollama_store import OllamaManifest

#: A request served by the fast path (:mod:`trioshed.api.pipeline.fast_path`, no Quart context): the app's
#: state, the request's body and its ASGI scope.
fast_request: ContextVar[tuple[AppState, bytes, dict[str, Any]] | None] = ContextVar(
    "trioshed_fast_request", default=None
)


def state() -> AppState:
    """The application's shared state (settings, store, scheduler)."""
    fast = fast_request.get()
    if fast is not None:
        return fast[0]
    return current_app.config["TRIOSHED"]  # type: ignore[no-any-return]


def store_writer() -> AppState:
    """The state, for a route that writes the model store (pull, push, create, blob uploads,
    copy, delete): the one place where who may change the store is decided: an admin key (the
    gate refuses a user key on these routes already; this holds for any route that forgets)."""
    key = current_key.get()
    if not key.admin:
        raise Forbidden(f"API key '{key.name}' may not change the model store: it needs an admin key (role = \"admin\" in the keys file)")
    return state()


async def read_body() -> dict[str, Any]:
    """The request body parsed: a JSON object, else BadRequest."""
    return (await read_body_raw())[1]


async def read_body_raw() -> tuple[bytes, dict[str, Any]]:
    """The request body as sent, and parsed (a JSON object, else BadRequest)."""
    fast = fast_request.get()
    raw = fast[1] if fast is not None else await request.get_data(as_text=False)
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
    """The request's ``keep_alive`` in seconds (``None``: the default), else BadRequest.

    A user key (not admin) may not unload a model (``keep_alive`` 0) nor keep it loaded for
    ever (negative): 403; a longer time than the server's ``TRIOSHED_KEEP_ALIVE`` is cut to it."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"invalid keep_alive: {exc}") from None
    key = current_key.get()
    if not key.admin:
        if seconds <= 0:
            what = "unload a model (keep_alive 0)" if seconds == 0 else "keep a model loaded for ever"
            raise Forbidden(f"API key '{key.name}' may not {what}: it needs an admin key (role = \"admin\" in the keys file)")
        seconds = min(seconds, state().settings.keep_alive)
    return seconds


def resolve(name: str) -> ModelSpec:
    """The model ``name`` names, if the request's key may use it: a model the key may not use is
    the same ModelNotFound as one that does not exist (the key never learns it is there)."""
    spec = state().store.resolve(name)
    if not current_key.get().may_use(spec.name):
        raise ModelNotFound(name)
    return spec


def visible(names: Iterable[str]) -> list[str]:
    """The names, of ``names``, the request's key may see."""
    key = current_key.get()
    return [n for n in names if key.may_use(n)]


@dataclass(frozen=True)
class Prepared:
    """A request's model and how to lease a runner for it."""

    model: ModelSpec
    options: RunnerOptions
    keep_alive: float | None
    #: The model's default options (models.toml / an Ollama store's params): sampling defaults
    #: go under the request's own.
    defaults: dict[str, Any]
    #: At most how many tokens the request takes (:func:`request_need`): sizes the automatic
    #: context, and says whether the prompt must be counted before the answer starts.
    need: int = 0
    #: Its output budget (:func:`output_budget`), and whether ``num_ctx`` is automatic (set by
    #: neither the settings, the model's entry nor the request).
    output: int = 0
    automatic: bool = False
    #: Whose request: the API key the gate found (the scheduler counts its limits and share).
    key: ApiKey = ANONYMOUS


def prepare(body: Mapping[str, Any], name: str, *, embedding: bool = False, need: int | None = None) -> Prepared:
    """Resolve model ``name`` and read ``keep_alive`` and ``options`` from ``body``.

    Raises ModelNotFound, or BadRequest for a bad ``keep_alive``, ``options`` or runner option.
    ``embedding``: a runner started with ``--embeddings``. ``need``: the tokens the request
    takes in one slot when the route knows better than :func:`request_need` (embeddings and
    rerank: the longest single input, not all of them together).
    """
    st = state()
    if st.fleet is None:
        model = resolve(name)
    else:  # the one place a request may go to another node (trioshed.fleet): raises Forward
        try:
            model = resolve(name)
        except ModelNotFound:
            st.fleet.route(name, None, body, embedding=embedding)
            raise
        st.fleet.route(name, model, body, embedding=embedding)
    keep_alive = keep_alive_of(body)
    overrides = body.get("options")
    if overrides is not None and not isinstance(overrides, dict):
        raise BadRequest("options must be an object")
    defaults = dict(model.defaults)
    _, runner_overrides = split_options({**defaults, **(overrides or {})})
    if need is None:
        need = request_need(body)
    options = st.runner_options(model, runner_overrides, need=need, embedding=embedding)
    automatic = not st.settings.context_length and "num_ctx" not in runner_overrides
    return Prepared(model, options, keep_alive, defaults, need, output_budget(body), automatic, current_key.get())


#: Tokens counted for one image or audio clip sent inline (base64 or a data: URI): what the
#: projectors seen produce for one image at most sizes (gemma3: 256, qwen2.5-vl: up to ~1,300).
MEDIA_TOKENS = 1024

_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def request_need(body: Mapping[str, Any]) -> int:
    """An upper bound on the tokens ``body`` takes in a runner's context: the UTF-8 bytes of its
    text (a tokenizer makes at most one token per byte), :data:`MEDIA_TOKENS` per inline image,
    a few tokens per message for the template's markers, and its output budget (``max_tokens``,
    ``options.num_predict``...). It sizes the automatic context; it never refuses a request."""
    text, media = _text_bytes({k: v for k, v in body.items() if k not in ("model", "options")})
    messages = body.get("messages")
    n_messages = len(messages) if isinstance(messages, list) else 1
    return tokens_upper_bound(text, n_messages, output=output_budget(body)) + MEDIA_TOKENS * media


def output_budget(body: Mapping[str, Any]) -> int:
    """The most tokens the request asks to generate (0: not said)."""
    output = 0
    for name in _OUTPUT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            output = max(output, value)
    options = body.get("options")
    if isinstance(options, dict):
        value = options.get("num_predict")
        if isinstance(value, int) and not isinstance(value, bool):
            output = max(output, value)
    return output


def _text_bytes(value: Any) -> tuple[int, int]:
    """UTF-8 bytes of every string in ``value`` (keys too: tool schemas render them), and how
    many inline media it holds (Ollama's ``images``, data: URIs, base64 ``data`` fields)."""
    if isinstance(value, str):
        if value.startswith("data:"):
            return 0, 1
        return len(value.encode("utf-8", "surrogatepass")), 0
    if isinstance(value, dict):
        text = media = 0
        for k, v in value.items():
            if k == "images" and isinstance(v, list):
                media += len(v)
                continue
            if k == "data" and isinstance(v, str) and value.get("type") == "base64":
                media += 1
                continue
            t, m = _text_bytes(v)
            text, media = text + len(str(k)) + t, media + m
        return text, media
    if isinstance(value, list):
        text = media = 0
        for item in value:
            t, m = _text_bytes(item)
            text, media = text + t, media + m
        return text, media
    if value is None or isinstance(value, bool):
        return 0, 0
    return len(str(value)), 0


async def has_chat_template(spec: ModelSpec) -> bool:
    """Whether the model's GGUF brings a chat template (unreadable: assume it does)."""
    try:
        meta = await state().metadata(spec)
    except Exception:
        return True  # let llama-server decide
    return bool(meta.chat_template)


async def model_capabilities(spec: ModelSpec) -> list[str] | None:
    """What the model can do, as ``/api/show`` reports it (the single source); ``None`` when its
    GGUF header cannot be read (then llama-server decides)."""
    try:
        meta = await state().metadata(spec)
    except Exception:
        return None
    return capabilities_of(spec, meta)


#: :func:`capabilities_of`'s answers, by the header they were read from (a header is read once
#: per file version and compares by identity) and what else they depend on: worked out once per
#: model version, not on every request (it walks every tensor's name).
_CAPABILITIES: dict[tuple[GGUFMetadata, str, str, str, tuple[int, int] | None], list[str]] = {}
_CAPABILITIES_KEPT = 64


def capabilities_of(spec: ModelSpec, meta: GGUFMetadata) -> list[str]:
    """What the model can do, from its header (and its Ollama manifest's template, if any)."""
    origin = spec.origin if isinstance(spec.origin, OllamaManifest) else None
    template = (origin.template if origin else "") or meta.chat_template or ""
    family = (origin.family if origin else "") or meta.architecture or ""
    key = (meta, template, family, spec.projector or "", _version(spec.projector))
    kept = _CAPABILITIES.get(key)
    if kept is not None:
        return list(kept)
    names = (t.name for t in meta.tensors)
    found = capabilities(meta.fields, template, projector=bool(spec.projector), projector_fields=_projector_fields(spec),
                         family=family, tensor_names=names)  # fmt: skip
    if len(_CAPABILITIES) >= _CAPABILITIES_KEPT:
        _CAPABILITIES.clear()
    _CAPABILITIES[key] = found
    return list(found)


def _version(path: str | None) -> tuple[int, int] | None:
    """A file's version (mtime, size), None without one or when it cannot be read."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _projector_fields(spec: ModelSpec) -> Mapping[str, Any] | None:
    """The projector's header key-values (cached after the first read of the small file), None
    without a projector or when it cannot be read (then llama-server says what is wrong)."""
    if not spec.projector:
        return None
    try:
        return read_metadata(spec.projector).fields
    except (OSError, ValueError):
        return None


async def require_kind(spec: ModelSpec, name: str, kind: str) -> None:
    """Refuse (400) a request a model of the other kind cannot serve, before any load: rerank
    (``kind`` ``"rerank"``) needs a reranker; embeddings (``"embedding"``) anything but one
    (a reranker's pooled output is a score, not a vector)."""
    has = await model_capabilities(spec)
    if has is None:
        return
    if kind == "rerank" and "rerank" not in has:
        raise BadRequest(f"{json.dumps(name)} does not support rerank")
    if kind == "embedding" and "rerank" in has:
        raise BadRequest(f"{json.dumps(name)} does not support embeddings")


async def require_capabilities(spec: ModelSpec, name: str, needs: Iterable[str], *, action: str = "chat") -> None:
    """Refuse (400) a request that needs what the model cannot do, with Ollama's words.

    ``needs``: Ollama capability names (``tools``, ``thinking``, ``vision``, ``audio``, ``insert``); a
    generating model (``completion``) is always needed: an embedding-only model answers
    ``"<name>" does not support <action>`` (``chat`` or ``generate``, as Ollama says). Thinking
    is checked first, as Ollama does; ``name`` is the model as the client named it.
    """
    has = await model_capabilities(spec)
    if has is None:
        return
    wanted = set(needs)
    if "thinking" in wanted and "thinking" not in has:
        raise BadRequest(f"{json.dumps(name)} does not support thinking")
    if "completion" not in has:
        raise BadRequest(f"{json.dumps(name)} does not support {action}")
    missing = [c for c in ("tools", "vision", "audio", "insert") if c in wanted and c not in has]
    if missing:
        raise BadRequest(f"{json.dumps(name)} does not support {', '.join(missing)}")

