"""The llama-server command line for a model, its runner options and its placement (pure).

llama-server's flags are spelled here and nowhere else: :func:`build_command` writes them, and
:func:`parse_model_args` reads the few in a model's ``models.toml`` args that trioshed must know
(its prompt cache, its RoPE scaling) into :class:`~trioshed.core.runner_options.ModelArgs`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trioshed.core.adapters import scales_of
from trioshed.core.estimate_kv import MetadataLike, batch_sizes
from trioshed.core.model import ModelSpec, Placement, RunnerOptions, rpc_endpoint
from trioshed.core.runner_options import ModelArgs
from trioshed.core.speculation import ngram_drafting
from trioshed.models.capabilities import is_reranker, pooling_type

if TYPE_CHECKING:
    from trioshed.runner.slots import WarmReturns

_LLAMA_BACKEND = {"cuda": "CUDA", "vulkan": "Vulkan", "rocm": "ROCm", "metal": "Metal", "sycl": "SYCL"}


def llama_device_name(device_id: str) -> str:
    """trioshed's ``"cuda:1"`` → llama.cpp's ``"CUDA1"``."""
    library, _, index = device_id.partition(":")
    return _LLAMA_BACKEND.get(library, library.upper()) + index


def device_names(devices: tuple[str, ...]) -> list[str]:
    """llama.cpp's ``--device`` names for ``devices``: local ones by backend (``CUDA0``), RPC
    servers as ``RPC0``, ``RPC1``, … in the order they are given to ``--rpc`` (what
    ``llama-server --rpc A,B --list-devices`` prints for servers with one device each)."""
    names, k = [], 0
    for d in devices:
        if rpc_endpoint(d):
            names.append(f"RPC{k}")
            k += 1
        else:
            names.append(llama_device_name(d))
    return names


#: The pooling trioshed asks for when the GGUF sets none (a generating model asked to embed):
#: llama-server's own default would then be "none", which its /v1/embeddings refuses ("Pooling
#: type 'none' is not OAI compatible"). Mean is what sentence-transformers uses for a model
#: without a pooling configuration, and what trioshed always passed before, so such models'
#: vectors are unchanged.
DEFAULT_POOLING = "mean"


def embedding_flags(options: RunnerOptions, meta: MetadataLike | None) -> list[str]:
    """The flags of an embedding or rerank runner: the model's own pooling, a micro-batch that
    holds one whole input (:func:`trioshed.core.estimate_kv.batch_sizes`, counted in the estimate).

    - a reranker (rank pooling or a classifier head): ``--rerank`` (rank pooling);
    - a GGUF that sets its pooling (mean, CLS, last): nothing, llama-server reads it;
    - a GGUF that sets none (or ``none``): ``--pooling mean`` (:data:`DEFAULT_POOLING`).
    """
    if not options.embedding:
        return []
    argv = ["--embeddings", "--ubatch-size", str(batch_sizes(options)[1])]
    fields = meta.fields if meta is not None else {}
    names = (t.name for t in meta.tensors) if meta is not None else ()
    if is_reranker(fields, names):
        argv += ["--rerank"]
    elif pooling_type(fields) in (None, 0):
        argv += ["--pooling", DEFAULT_POOLING]
    return argv


def _split(values: tuple[float, ...] | list[int]) -> str:
    return ",".join(f"{x:.4g}" for x in values)


def ngram_args(speculation: str) -> list[str]:
    """The ``--spec-*`` flags for an n-gram setting (none for ``"off"``;
    :func:`trioshed.core.speculation.ngram_drafting`)."""
    drafting = ngram_drafting(speculation)
    if drafting is None:
        return []
    argv = ["--spec-type", drafting.kind]
    if drafting.lookup is not None:
        argv += ["--spec-ngram-simple-size-n", str(drafting.lookup)]
    if drafting.draft is not None:
        argv += ["--spec-ngram-simple-size-m", str(drafting.draft)]
    return argv


#: The flags ``"ngram"`` (the measured default) stands for.
NGRAM: tuple[str, ...] = tuple(ngram_args("ngram"))


def speculation_args(
    options: RunnerOptions, placement: Placement, *, accounting_only: bool = False, kv_cache_type: str = "f16"
) -> list[str]:
    """Speculative decoding's flags (``trioshed.core.speculation``).

    A draft model (``options.draft``) goes where the placement put it (``placement.draft_device``:
    a GPU with every draft layer, or system memory), with the target's KV cache type; it is
    counted in the placement's bytes (``trioshed.core.estimate.draft_bytes``). Otherwise the
    n-gram kind ``options.speculation`` names (nothing for ``"off"``).
    """
    if not options.draft:
        return ngram_args(options.speculation)
    argv = ["--model-draft", options.draft, "--spec-type", "draft-simple"]
    device = placement.draft_device
    if device and not accounting_only and not rpc_endpoint(device):
        argv += ["--spec-draft-ngl", "all", "--device-draft", llama_device_name(device)]
    else:
        argv += ["--spec-draft-ngl", "0", "--device-draft", "none"]
    if options.flash_attention and kv_cache_type != "f16":
        argv += ["--cache-type-k-draft", kv_cache_type, "--cache-type-v-draft", kv_cache_type]
    return argv


@functools.lru_cache(maxsize=256)
def parse_model_args(args: tuple[str, ...]) -> ModelArgs:
    """What a model's ``models.toml`` args mean to the runner options.

    ``--cache-ram N`` is the model's own prompt-cache size: taken out of the args (every runner
    gets an explicit ``--cache-ram``, the size counted in the estimate); one that cannot be read
    stays in the args and the setting's size is counted. ``--rope-scale N`` multiplies the trained
    context by N; ``--rope-scaling`` or ``--yarn-orig-ctx`` (or an unreadable ``--rope-scale``)
    lift its limit: the user scales RoPE themselves.
    """
    passed, cache_ram = args, None
    if "--cache-ram" in args:
        at = args.index("--cache-ram")
        try:
            cache_ram = max(0, int(args[at + 1]))
            passed = args[:at] + args[at + 2 :]
        except (IndexError, ValueError):
            pass
    scale, unbounded = None, False
    if "--rope-scale" in args:
        try:
            scale = float(args[args.index("--rope-scale") + 1])
        except (IndexError, ValueError):
            pass
        if scale is None or not math.isfinite(scale):
            scale, unbounded = None, True
    elif "--rope-scaling" in args or "--yarn-orig-ctx" in args:
        unbounded = True
    return ModelArgs(passed=passed, cache_ram_mib=cache_ram, rope_scale=scale, rope_unbounded=unbounded)


def lora_args(model: ModelSpec) -> list[str]:
    """The adapters a runner of ``model`` (a :func:`trioshed.core.adapters.runner_model`) loads:
    one comma-separated ``--lora`` (b10068 warns that a repeated flag keeps only the last), ids
    in that order; ``--lora-scaled FILE:SCALE,…`` when a runner that cannot select per request
    (embeddings) applies fixed scales other than 1. A path holding a comma cannot be passed
    (the store refuses such adapters), nor one with a colon to ``--lora-scaled``."""
    if not model.adapters:
        return []
    if any("," in a for a in model.adapters):
        raise ValueError(f"an adapter path of {model.name} holds a comma, which llama-server's --lora cannot take")
    scales = scales_of(model)
    if all(s == 1.0 for s in scales):
        return ["--lora", ",".join(model.adapters)]
    if any(":" in a for a in model.adapters):
        raise ValueError(f"an adapter path of {model.name} holds a colon, which llama-server's --lora-scaled cannot take")
    return ["--lora-scaled", ",".join(f"{a}:{s:g}" for a, s in zip(model.adapters, scales, strict=True))]


@dataclass(frozen=True)
class LaunchConfig:
    """Process-wide runner settings (not per request)."""

    binary: str
    env: tuple[tuple[str, str], ...] = ()
    load_timeout: float = 300.0
    verbose: bool = True  # llama-server prints its buffer sizes only when verbose
    accounting_only: bool = False  # declared inventory: children run on the CPU
    stop_grace: float = 5.0
    #: Warm returns (``trioshed.runner.slots``): the saved-slot store (its folder is the
    #: runners' ``--slot-save-path``) and the bound on saves; None: off.
    warm: WarmReturns | None = None
    #: The port a runner's first start uses (0: one found free; a test gives one it holds).
    port: int = 0


def build_command(
    binary: str,
    model: ModelSpec,
    options: RunnerOptions,
    placement: Placement,
    *,
    port: int,
    verbose: bool = True,
    accounting_only: bool = False,
    kv_cache_type: str | None = None,
    slot_save_path: str | None = None,
    meta: MetadataLike | None = None,
) -> list[str]:
    """llama-server argv. trioshed decides placement itself, so ``--fit off`` with explicit ``-ngl``.

    ``accounting_only`` (a declared inventory, no real GPU): the scheduler accounts memory as if
    the runner sat on ``placement.devices`` while the child itself runs on the CPU.
    ``kv_cache_type`` is the type the model really supports (``core.estimate_kv.effective_kv_type``);
    it defaults to the requested one. ``meta`` (the GGUF header) decides an embedding runner's
    pooling (:func:`embedding_flags`).

    ``--cache-ram`` is always explicit (``options.cache_ram_mib``, counted in the estimate; b10068
    would otherwise keep up to 8 GiB of prompts in host memory per runner). ``--swa-full`` with
    ``options.swa_full`` (a no-op for models without sliding-window layers); ``slot_save_path``
    enables the slot save/restore files (warm returns).

    A placement over RPC servers adds ``--rpc host:port,…`` (the servers in placement order) and
    names them ``RPC0``… in ``--device``. With ``accounting_only`` its local share runs on the CPU
    while the RPC servers are real: ``--device`` lists only them, ``-ngl`` is the number of
    layers planned on them and ``--tensor-split`` their layer counts: as ``-ngl k`` offloads the
    output layer and the last ``k - 1`` repeating layers, those are exactly the layers the plan put
    on the RPC servers (the local share is the first of the offloaded ones).
    """
    remote = [
        (d, n) for d, n in zip(placement.devices, placement.layers or (0,) * len(placement.devices), strict=True)
        if rpc_endpoint(d)
    ]
    if accounting_only:
        ngl = sum(n for _, n in remote)
    else:
        ngl = placement.n_gpu_layers
    argv = [
        binary,
        "--model", model.path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(options.kv_cells),
        "--parallel", str(options.num_parallel),
        "--batch-size", str(batch_sizes(options)[0]),
        "--fit", "off",
        "--n-gpu-layers", str(ngl),
        "--no-webui",
        "--log-colors", "off",
        "--alias", model.name,
    ]  # fmt: skip
    if options.num_thread > 0:
        argv += ["--threads", str(options.num_thread)]
    if placement.endpoints:
        argv += ["--rpc", ",".join(placement.endpoints)]
    if placement.devices and not accounting_only:
        argv += ["--device", ",".join(device_names(placement.devices))]
        if placement.tensor_split:
            argv += ["--tensor-split", _split(placement.tensor_split)]
        if placement.main_gpu is not None:
            argv += ["--main-gpu", str(placement.main_gpu)]
    elif remote and ngl > 0:
        argv += ["--device", ",".join(device_names(tuple(d for d, _ in remote)))]
        if len(remote) > 1:
            argv += ["--tensor-split", _split([n for _, n in remote])]
    else:
        argv += ["--device", "none"]
    cache_type = kv_cache_type or options.kv_cache_type
    if options.flash_attention:
        argv += ["--flash-attn", "on"]
        if cache_type != "f16":
            argv += ["--cache-type-k", cache_type, "--cache-type-v", cache_type]
    else:
        argv += ["--flash-attn", "off"]
    argv += ["--cache-ram", str(max(0, options.cache_ram_mib))]
    if options.swa_full:
        argv += ["--swa-full"]
    if slot_save_path:
        argv += ["--slot-save-path", slot_save_path]
    argv += embedding_flags(options, meta)
    if options.use_mmap is False:
        argv += ["--no-mmap"]
    if options.batch_invariant:
        argv += ["--no-repack"]
    argv += lora_args(model)
    if model.projector:
        argv += ["--mmproj", model.projector]
    argv += speculation_args(options, placement, accounting_only=accounting_only, kv_cache_type=cache_type)
    argv += options.extra_args  # models.toml args: allow-listed flags trioshed does not set
    if verbose:
        # Level 4 (trace) prints the buffer sizes the memory log needs; --verbose would also
        # log every token (~300 lines per 16-token request against ~20 here).
        argv += ["--log-verbosity", "4"]
    return argv
