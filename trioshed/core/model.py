"""The plain values that the scheduler's pure decisions take and return.

Nothing here performs I/O or imports trio: estimates, placement, eviction and queue decisions
are functions over these frozen dataclasses, tested without processes or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3
MiB = 1024**2

#: Cache types llama-server accepts for ``--cache-type-k/-v``; the quantized ones need flash attention.
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")


#: The library of remote devices: one llama.cpp RPC server each, id ``"rpc:<host>:<port>"``.
RPC_LIBRARY = "rpc"


def rpc_endpoint(device_id: str) -> str:
    """``"rpc:10.0.0.2:50052"`` → ``"10.0.0.2:50052"``; ``""`` for a local device id."""
    prefix = RPC_LIBRARY + ":"
    return device_id[len(prefix) :] if device_id.startswith(prefix) else ""


@dataclass(frozen=True)
class Device:
    """One place a runner's memory can live.

    ``id`` is ``"<library>:<index>"`` (``"cuda:0"``), ``"cpu"`` for system memory.
    ``free`` is what the caller considers free *now* (the scheduler has already subtracted the
    loaded runners' use and the per-GPU overhead before calling placement).
    """

    id: str
    library: str
    index: int
    total: int
    free: int
    name: str = ""
    #: The largest tensor the device takes (0: no limit known). llama.cpp's Vulkan backend refuses
    #: an op with a tensor bigger than the device's ``maxStorageBufferRange``, so such a weight
    #: stays in system memory (lavapipe: 128 MiB, so gemma3's 170 MiB tied output stays on the
    #: CPU) and such an attention runs on the CPU (``core.estimate_compute.attention_on_host``).
    max_tensor: int = 0

    @property
    def is_cpu(self) -> bool:
        return self.library == "cpu"

    @property
    def is_remote(self) -> bool:
        """A llama.cpp RPC server (``TRIOSHED_RPC_SERVERS``): id ``"rpc:<host>:<port>"``."""
        return self.library == RPC_LIBRARY

    @property
    def endpoint(self) -> str:
        """``host:port`` of a remote device (``""`` for a local one)."""
        return rpc_endpoint(self.id)


@dataclass(frozen=True)
class RunnerOptions:
    """The options that define a runner process: a request whose options differ needs a reload.

    ``num_ctx`` is the context per slot; the runner's KV cache holds ``num_ctx * num_parallel`` cells.
    ``num_gpu`` is the layer count on GPUs: -1 = automatic, 0 = CPU only, N = exactly N layers.
    ``num_thread`` 0 lets llama-server choose. A runner with ``embedding`` also generates, so a
    generation request never reloads one; an embedding request needs one.
    """

    num_ctx: int = 4096
    num_batch: int = 512
    num_gpu: int = -1
    main_gpu: int = 0
    use_mmap: bool | None = None
    num_thread: int = 0
    num_parallel: int = 1
    kv_cache_type: str = "f16"
    flash_attention: bool = False
    #: ``--embeddings`` (or ``--rerank`` for a reranker) with the model's own pooling, and a
    #: micro-batch of the whole context (``core.estimate_kv.batch_sizes``); generates as well.
    embedding: bool = False
    #: ``--cache-ram``: llama-server's host-memory prompt cache, MiB (0 = off). It always sits in
    #: system memory and the estimate counts all of it (a positive limit binds in bytes).
    cache_ram_mib: int = 0
    #: ``--swa-full``: sliding-window layers keep a full-size cache, so that a restored slot
    #: (warm returns, ``trioshed.core.kvcache``) is reused; the estimate counts the larger cache.
    swa_full: bool = False
    extra_args: tuple[str, ...] = ()  # models.toml ``args`` (checked against an allow-list)
    #: Speculative decoding (``trioshed.core.speculation``): ``"off"``, ``"ngram"`` or an
    #: n-gram kind by llama.cpp's name; ignored while ``draft`` is set.
    speculation: str = "off"
    #: A draft model's GGUF file (``--model-draft``; "" = none), placed and counted with the target.
    draft: str = ""
    #: Kernels that give a token checked in a verification batch the numbers it gets alone
    #: (``--no-repack``, with flash attention on; measured on the CPU): the same tokens at
    #: temperature 0 with or without speculation; no repacked copy of the weights to count.
    batch_invariant: bool = False

    @property
    def kv_cells(self) -> int:
        return self.num_ctx * self.num_parallel


@dataclass(frozen=True)
class MemoryEstimate:
    """What a model is predicted to need, in bytes, for one set of runner options.

    ``layers[i]`` is repeating layer i's weights plus its KV cache: the unit that ``-ngl`` moves.
    ``total`` is everything on one device at full offload:
    ``weights + kv + output + token_embd + compute_full + projector + adapters``.
    """

    weights: int
    kv: int
    output: int
    token_embd: int
    compute_full: int
    compute_partial: int
    layers: tuple[int, ...]
    projector: int = 0
    adapters: int = 0
    #: Bytes of ``output`` that cost nothing while the output layer stays in system memory: with
    #: tied embeddings (no ``output.weight``, e.g. gemma3) llama.cpp reuses ``token_embd.weight``,
    #: a second copy only on a GPU. Added by trioshed.core.estimate.
    output_shared: int = 0
    #: Extra system memory when every layer runs on the CPU: llama.cpp's CPU backend keeps a
    #: repacked copy of some quantized weights (``CPU_REPACK`` buffer; Q4_0/Q4_K/IQ4_NL on x86).
    cpu_repack: int = 0
    #: llama-server's host-memory prompt cache at its ``--cache-ram`` limit: system memory
    #: wherever the layers go (counted in ``cpu_total`` and in every placement's ``ram``).
    prompt_cache: int = 0
    #: With layers on a GPU (measured on Vulkan; see trioshed.core.estimate): the GPU's compute
    #: buffer at full and at partial offload, and the system-memory side (the host compute
    #: buffer: inputs and attention masks, plus the logits output buffer) at full and at partial
    #: offload. None: the CPU figures (``compute_full``/``compute_partial`` on the GPU, nothing
    #: on the host at full offload, ``compute_partial`` at partial offload).
    gpu_compute_full: int | None = None
    gpu_compute_partial: int | None = None
    host_compute_full: int | None = None
    host_compute_partial: int | None = None
    #: The output layer's largest tensor (``output.weight``, or the tied ``token_embd.weight``):
    #: it stays in system memory on a device whose ``max_tensor`` it exceeds.
    output_tensor: int = 0
    #: A draft model's own estimate (``RunnerOptions.draft``): llama-server gives it a context
    #: like the target's (same cells, slots and batch; measured on b10068). Placement puts it on
    #: the target's first GPU when every target layer is there, else in system memory.
    draft: MemoryEstimate | None = None

    def gpu_compute(self, full: bool) -> int:
        """The GPU's compute buffer with every layer (``full``) or some of them offloaded."""
        if full:
            return self.compute_full if self.gpu_compute_full is None else self.gpu_compute_full
        return self.compute_partial if self.gpu_compute_partial is None else self.gpu_compute_partial

    def host_compute(self, full: bool) -> int:
        """System memory for compute while some layers (all when ``full``) are on a GPU."""
        if full:
            return 0 if self.host_compute_full is None else self.host_compute_full
        return self.compute_partial if self.host_compute_partial is None else self.host_compute_partial

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.kv
            + self.output
            + self.token_embd
            + self.compute_full
            + self.projector
            + self.adapters
            + (self.draft.total if self.draft is not None else 0)
        )

    @property
    def cpu_total(self) -> int:
        """Everything in system memory (``-ngl 0``): ``total`` less the tied output copy, plus
        the CPU backend's repacked weights and the prompt cache."""
        draft = self.draft.cpu_total - self.draft.total if self.draft is not None else 0
        return self.total - self.output_shared + self.cpu_repack + self.prompt_cache + draft


@dataclass(frozen=True)
class Placement:
    """Where a runner goes: the llama-server flags and the bytes it will take on each device.

    ``devices`` are the GPU ids used, in ``--device`` order (empty = CPU only); remote devices
    (``"rpc:<host>:<port>"``) come after the local ones.
    ``vram`` maps device id to bytes predicted on it; ``ram`` is the system-memory part.
    ``layers`` (set when the placement spans RPC servers) is the number of offloaded layers on
    each entry of ``devices``, the output layer counted on the last: ``tensor_split`` is then
    these counts, so llama.cpp assigns exactly these layers.
    """

    n_gpu_layers: int
    devices: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] | None = None
    main_gpu: int | None = None
    vram: tuple[tuple[str, int], ...] = ()
    ram: int = 0
    layers: tuple[int, ...] = ()
    #: Where a draft model (``RunnerOptions.draft``) goes: a device id holding all its layers,
    #: or None for system memory. Its bytes are in ``vram``/``ram`` with the target's.
    draft_device: str | None = None

    @property
    def vram_total(self) -> int:
        return sum(b for _, b in self.vram)

    @property
    def total(self) -> int:
        return self.vram_total + self.ram

    @property
    def on_cpu_only(self) -> bool:
        return not self.devices

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The RPC servers this runner uses (``host:port``), in ``--rpc`` order."""
        return tuple(e for e in map(rpc_endpoint, self.devices) if e)


@dataclass(frozen=True)
class DoesNotFit:
    """The model cannot be placed even on the devices given; numbers for the error message."""

    needed: int
    available: int
    reason: str = ""


@dataclass(frozen=True)
class MeasuredMemory:
    """Buffer sizes llama.cpp reported for a running model (parsed from its verbose log), bytes."""

    model: dict[str, int] = field(
        default_factory=dict
    )  # buffer name ("CPU_Mapped", "CUDA0") -> bytes
    kv: int = 0
    kv_k: int = 0
    kv_v: int = 0
    compute: dict[str, int] = field(default_factory=dict)  # backend ("CPU", "CUDA0") -> bytes
    #: Logits/embeddings output buffers (``output buffer size``), backend -> bytes.
    output: dict[str, int] = field(default_factory=dict)
    #: KV (and recurrent-state) buffers by backend ("CPU", "Vulkan0"), when reported.
    kv_buffers: dict[str, int] = field(default_factory=dict)
    #: A multimodal projector's weights and compute buffers, backend -> bytes (``--mmproj``).
    projector: dict[str, int] = field(default_factory=dict)
    projector_compute: dict[str, int] = field(default_factory=dict)
    #: LoRA adapters' tensors (``LoRA buffer size``), buffer name -> bytes: each on the buffer
    #: of the base layer it adapts.
    adapters: dict[str, int] = field(default_factory=dict)

    def by_backend(self) -> dict[str, int]:
        """Every reported buffer summed per backend name (``CPU_Mapped``, ``Vulkan0``,
        ``Vulkan_Host``...): what each device really holds."""
        out: dict[str, int] = {}
        kv = self.kv_buffers if sum(self.kv_buffers.values()) else {"CPU": self.kv}
        for part in (self.model, kv, self.compute, self.output, self.projector, self.projector_compute, self.adapters):
            for name, n in part.items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def weights(self) -> int:
        return sum(self.model.values())

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.kv
            + sum(self.compute.values())
            + sum(self.output.values())
            + sum(self.projector.values())
            + sum(self.projector_compute.values())
            + sum(self.adapters.values())
        )


@dataclass(frozen=True)
class ModelSpec:
    """A model as the store resolved it: what a runner is started from.

    ``name`` is the full ``name:tag``; ``path`` the GGUF file; ``adapters`` the model's own LoRA
    adapters (applied at ``adapter_scales``, 1.0 each when empty) and ``projector`` (``--mmproj``).
    ``group``: the adapters of every model in the store on the same base file with the same
    runner settings (:mod:`trioshed.core.adapters`), which one runner loads for them all; each
    request then selects its model's adapters (llama-server's per-request ``lora``). Two requests
    share a runner when the base file and projector are the same and the runner holds the
    request's adapters (see ``core.views.can_serve``).

    From ``models.toml`` (``trioshed.models.catalogue``): ``num_parallel`` (slots; None =
    TRIOSHED_NUM_PARALLEL), ``keep_alive`` (seconds; None = TRIOSHED_KEEP_ALIVE; a request's own
    wins), ``pinned`` (never a victim), ``priority`` (higher is planned first), ``args`` (extra
    llama-server flags).
    """

    name: str
    path: str
    adapters: tuple[str, ...] = ()
    projector: str | None = None
    size: int = 0
    modified: float = 0.0
    defaults: tuple[tuple[str, object], ...] = ()
    num_parallel: int | None = None
    keep_alive: float | None = None
    pinned: bool = False
    priority: int = 0
    args: tuple[str, ...] = ()
    #: ``models.toml``'s ``speculation`` (None = TRIOSHED_SPECULATION) and ``draft`` (a model
    #: name from the store; None = none), see ``trioshed.core.speculation``.
    speculation: str | None = None
    draft: str | None = None
    #: The model's default system prompt (an Ollama store's ``system`` layer), used when a
    #: request brings none.
    system: str = ""
    #: Where the store found it, for /api/tags and /api/show (an Ollama manifest); not part
    #: of the model's identity.
    origin: object | None = field(default=None, compare=False, repr=False)
    #: Why the store paired no projector with this model although its folder holds some (an
    #: ambiguous folder: see ``trioshed.models.projectors``), for ``/api/show``; "" otherwise.
    projector_problem: str = field(default="", compare=False)
    #: the scale of each of ``adapters`` (empty: 1.0 each)
    adapter_scales: tuple[float, ...] = ()
    #: the adapters a runner of this model's base loads (its own and its siblings', stable
    #: order); empty: only its own (``trioshed.core.adapters``)
    group: tuple[str, ...] = ()
    #: With a group: the base file's identity (device, inode, size, mtime), which the group's
    #: models share whatever their names, sizes and dates as their stores list them; their
    #: ``path`` and ``projector`` are then the group's own spelling of those files
    base: tuple[int, ...] = ()

    @property
    def short_name(self) -> str:
        return self.name.removesuffix(":latest")
