"""What a runner is started with, from everything that has a say in it (pure).

One function, :func:`runner_options`, turns the server's settings, the model's ``models.toml``
spec, facts from its GGUF header and a request's option overrides into the
:class:`~trioshed.core.model.RunnerOptions` that define a runner process. Precedence, lowest
first: the settings, the model's defaults (``models.toml`` options), the request's options.

* **Context** (``num_ctx``): set by none of them it is automatic, the bucket of the request's
  ``need`` (:func:`trioshed.core.context.automatic_context`); either way at least 4 and clamped to
  the trained context, and ``num_batch`` to ``num_ctx`` (:func:`~trioshed.core.context.clamp`).
  ``models.toml`` args that scale RoPE themselves are the user's word (:class:`ModelArgs`).
* **Speculation**: the model's setting, else the server's; off for a model that writes no text
  (embedding, rerank): nothing to draft. A draft model is resolved by the caller (a path).
* **Flash attention** (:func:`flash_attention`): on for batch-invariant runners (which need it),
  else ``TRIOSHED_FLASH_ATTENTION`` when set, else automatic: on where every backend the runner
  may use has the kernel (llama.cpp's own ``auto`` turns it off when the attention op would run
  on another device than the KV cache, the sign of a backend without it).
* **Prompt cache** (``cache_ram_mib``): the setting, unless the model's args set their own; none
  for a runner that selects LoRA adapters per request (llama-server matches that cache by tokens
  only, whatever adapters computed them: :mod:`trioshed.core.adapters`) or serves embeddings.
* **swa_full** while warm returns keep KV caches (a restored SWA slot is reused only so).

Values no model can use are refused with 400 (:data:`RUNNER_BOUNDS`) before the scheduler sees
them: ``num_ctx`` sizes a KV cache and ``num_gpu`` a placement, and an absurd value would load, or
evict to make room for, a runner that serves nobody. Within the bounds Ollama's meaning holds
(``num_gpu`` above the layer count offloads everything, ``num_ctx`` 1-3 becomes 4).

llama-server's own flags are read by :func:`trioshed.runner.command.parse_model_args`; this
module sees only what they mean (:class:`ModelArgs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from trioshed.core.adapters import runner_model, selects
from trioshed.core.context import FLOOR, automatic_context, clamp
from trioshed.core.model import MiB, ModelSpec, RunnerOptions
from trioshed.core.speculation import OFF
from trioshed.errors import BadRequest

#: The request options that choose a runner (the others are sampling options for llama-server).
RUNNER_FIELDS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"})

MAX_NUM_CTX = 1 << 24  # 16 Mi tokens: above every model's training context (Llama 4 Scout: 10 M)
MAX_NUM_GPU = 1 << 16  # layers; "999" (= all) is a common idiom, no model has 65 Ki layers
MAX_NUM_THREAD = 1 << 12
MAX_NUM_BATCH = 1 << 20

#: name -> (lowest, highest) accepted
RUNNER_BOUNDS: dict[str, tuple[int, int]] = {
    "num_ctx": (1, MAX_NUM_CTX),
    "num_gpu": (-1, MAX_NUM_GPU),
    "main_gpu": (0, 1 << 10),
    "num_thread": (0, MAX_NUM_THREAD),
    # llama-server's warm-up decodes 2 tokens in one batch: num_batch 1 aborts it at start-up
    # (GGML_ASSERT n_tokens_all <= n_batch, found by fuzzing), and the model's load back-off then
    # refused everyone's requests for it
    "num_batch": (2, MAX_NUM_BATCH),
}


class RunnerSettings(Protocol):
    """The server settings runner options start from (:class:`trioshed.config.Settings`)."""

    @property
    def context_length(self) -> int: ...  # 0: automatic
    @property
    def context_max(self) -> int: ...  # caps the automatic context; 0: none
    @property
    def num_parallel(self) -> int: ...
    @property
    def num_thread(self) -> int: ...
    @property
    def kv_cache_type(self) -> str: ...
    @property
    def flash_attention(self) -> bool | None: ...  # None: automatic
    @property
    def batch_invariant(self) -> bool: ...
    @property
    def cache_ram(self) -> int: ...  # bytes
    @property
    def kv_cache_budget(self) -> int: ...  # bytes; > 0: warm returns on
    @property
    def speculation(self) -> str: ...


class ContextFacts(Protocol):
    """What the GGUF header says about context (:class:`trioshed.models.gguf_meta.GGUFMetadata`)."""

    @property
    def context_length(self) -> int: ...  # ``<arch>.context_length``
    @property
    def trained_context(self) -> int: ...  # with the GGUF's own RoPE scaling


@dataclass(frozen=True)
class ModelArgs:
    """What a model's ``models.toml`` args mean to trioshed (parsed by
    :func:`trioshed.runner.command.parse_model_args`).

    ``passed``: the args handed on to llama-server as they are. ``cache_ram_mib``: the model's own
    prompt-cache size (None: the setting's); trioshed passes it itself, and counts it.
    ``rope_scale``: the user scales RoPE by this factor, so the trained context is
    ``context_length`` times it; ``rope_unbounded``: the user scales RoPE another way (or by a
    factor that could not be read), so no trained context limits ``num_ctx``.
    """

    passed: tuple[str, ...] = ()
    cache_ram_mib: int | None = None
    rope_scale: float | None = None
    rope_unbounded: bool = False


def check_runner_options(options: Mapping[str, Any]) -> None:
    """Raise BadRequest for a runner option outside :data:`RUNNER_BOUNDS` (types are checked
    where options are parsed)."""
    for name, (low, high) in RUNNER_BOUNDS.items():
        value = options.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
            raise BadRequest(f"option {name}={value} is out of range: use {low} to {high}")


def trained_context(header: ContextFacts | None, args: ModelArgs = ModelArgs()) -> int:
    """The model's trained context (0: unknown, its ``header`` unreadable, or lifted by ``args``)."""
    if header is None or args.rope_unbounded:
        return 0
    if args.rope_scale is not None:
        return int(header.context_length * args.rope_scale)
    return header.trained_context


#: The backends (``Device.library``) whose devices all run flash attention in the pinned
#: llama-server (b10068), where llama-server's own default (``auto``) turns it on too. Measured on
#: the CPU (Gemma 3 270M, one thread): prompts 7 % and generation 3 % faster than without
#: (docs/benchmarks.md), and a smaller compute buffer. Not Vulkan: its kernel is missing on some
#: devices (on lavapipe, whose buffers are limited, attention at a long context runs on the host,
#: which llama.cpp's ``auto`` answers by turning flash attention off), nor an RPC server's
#: unknown backend.
FLASH_ATTENTION_KERNELS = frozenset({"cpu", "cuda", "metal", "rocm"})


def flash_attention(setting: bool | None, *, batch_invariant: bool = False, backends: tuple[str, ...] = ("cpu",)) -> bool:
    """Whether a runner runs with flash attention: always for batch-invariant runners, else the
    setting when given (``True``/``False``), else (``None``, automatic) where every backend the
    runner may use (``backends``: device libraries, ``"cpu"`` for system memory) has the kernel;
    a backend without it (an RPC server's, an unknown one) would run the op on another device,
    which llama.cpp's own ``auto`` answers by turning it off."""
    if batch_invariant:
        return True
    if setting is not None:
        return setting
    return all(b in FLASH_ATTENTION_KERNELS for b in backends)


def speculation(settings: RunnerSettings, spec: ModelSpec, *, writes_text: bool = True) -> str:
    """The model's speculation setting, else the server's; off for a model that writes no text."""
    chosen = spec.speculation or settings.speculation
    return chosen if writes_text else OFF


def _cache_ram_mib(settings: RunnerSettings, spec: ModelSpec, args: ModelArgs, embedding: bool) -> int:
    """The runner's host-memory prompt cache, MiB (see the module's docstring)."""
    if selects(runner_model(spec, embedding=embedding)):
        return 0  # a prefix computed under one adapter would be reused under another
    if args.cache_ram_mib is not None:
        return args.cache_ram_mib
    return 0 if embedding else settings.cache_ram // MiB


def runner_options(
    settings: RunnerSettings,
    spec: ModelSpec,
    overrides: Mapping[str, Any],
    *,
    need: int = 0,
    header: ContextFacts | None = None,
    writes_text: bool = True,
    args: ModelArgs = ModelArgs(),
    draft: str = "",
    backends: tuple[str, ...] = ("cpu",),
    embedding: bool = False,
) -> RunnerOptions:
    """The runner options for a request for ``spec``.

    ``overrides``: the request's options (those in :data:`RUNNER_FIELDS` count; None is unset).
    ``need``: an upper bound on the request's tokens, prompt and output, which sizes an automatic
    context. ``header``: the model's GGUF header (None: unreadable; the load reports that, and no
    trained context is known). ``writes_text``: whether the model writes text (as the header says;
    true when unreadable). ``args``: the model's ``models.toml`` args as parsed (``spec.args``
    themselves are not read here). ``draft``: the draft model's GGUF file, resolved ("" = none).
    ``backends``: the device libraries the runner may use (:func:`flash_attention`).
    ``embedding``: a runner started with ``--embeddings``, which has no prompt cache unless the
    model's args set one (embeddings never reuse a cached prompt; the cache's upkeep and its
    trace lines cost 8 % of an indexing run's CPU, measured).
    Raises BadRequest for an option out of bounds or of the wrong kind.
    """
    merged: dict[str, Any] = {k: v for k, v in spec.defaults if k in RUNNER_FIELDS}
    merged.update({k: v for k, v in overrides.items() if k in RUNNER_FIELDS and v is not None})
    check_runner_options(merged)
    trained = trained_context(header, args)
    automatic = not settings.context_length and "num_ctx" not in merged
    fields: dict[str, Any] = {
        "num_ctx": automatic_context(need, trained, settings.context_max) if automatic else settings.context_length or FLOOR,
        "num_parallel": spec.num_parallel or settings.num_parallel,
        "num_thread": settings.num_thread,
        "kv_cache_type": settings.kv_cache_type,
        "flash_attention": flash_attention(settings.flash_attention, batch_invariant=settings.batch_invariant, backends=backends),
        "cache_ram_mib": _cache_ram_mib(settings, spec, args, embedding),
        "embedding": embedding,
        "swa_full": settings.kv_cache_budget > 0,
        "extra_args": args.passed,
        "speculation": speculation(settings, spec, writes_text=writes_text),
        "draft": draft,
        "batch_invariant": settings.batch_invariant,
    }
    try:
        options = RunnerOptions(**{**fields, **merged})  # built once: the request's options over the rest
    except TypeError as exc:
        raise BadRequest(f"invalid runner option: {exc}") from None
    if options.num_ctx < 4:
        options = replace(options, num_ctx=4)
    return clamp(options, trained)

