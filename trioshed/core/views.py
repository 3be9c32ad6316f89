"""What the planner sees: frozen snapshots of the runners, the waiting requests and the machine,
and the questions every part of scheduling asks of them (can this runner serve that request
without a reload; which runner goes first when one must; what a runner holds on each device).

Pure: plain dataclasses, no I/O, no clock. The planner (:mod:`trioshed.core.sched`) takes these
and returns actions; the scheduler (:mod:`trioshed.scheduler`) builds them from its live state.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from trioshed.core import adapters
from trioshed.core.adapter_turns import Turns
from trioshed.core.model import (
    Device,
    DoesNotFit,
    MeasuredMemory,
    MemoryEstimate,
    ModelSpec,
    Placement,
    RunnerOptions,
)
from trioshed.core.own_runner import SetDemand

CPU_ID = "cpu"


class RunnerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


@dataclass(frozen=True)
class RunnerView:
    id: int
    model: ModelSpec
    options: RunnerOptions
    state: RunnerState
    leases: int = 0
    evicting: bool = False
    keep_alive: float = 300.0
    last_used: float = 0.0
    usage: tuple[tuple[str, int], ...] = ()  # bytes per device id ("cpu" = system memory)
    pinned: bool = False  # models.toml pinned: never chosen as a victim
    #: Its latest request came while it was busy or within ``core.queue.RECENTLY_USED`` seconds of
    #: the one before: its clients come straight back, so a recent use holds a swap.
    came_back: bool = False
    #: Its child has exited, though its lifetime task may not have seen it yet (a starved
    #: event loop): it is leaving, and serves nothing.
    exited: bool = False
    #: An adapter group's runner: the turns its adapter sets take (``core.adapter_turns``);
    #: None for any other runner.
    turns: Turns | None = None
    #: An adapter group's runner: each adapter set's demand on it lately (``core.own_runner``),
    #: and how long its load took
    demand: tuple[SetDemand, ...] = ()
    load_seconds: float = 0.0
    #: A runner of one model's own adapters beside its group's (a hot adapter set's, or under
    #: memory pressure): never superseded by the group's runner
    own: bool = False

    @property
    def slots(self) -> int:
        return self.options.num_parallel

    @property
    def idle(self) -> bool:
        return self.leases == 0

    @property
    def leaving(self) -> bool:
        """Being evicted or unloaded, or its child exited: it takes no new lease, and its memory
        is on its way out."""
        return self.evicting or self.exited or self.state is RunnerState.UNLOADING

    @property
    def in_system_memory(self) -> bool:
        return all(dev == CPU_ID for dev, _ in self.usage)


@dataclass(frozen=True)
class RequestView:
    id: int
    model: ModelSpec
    options: RunnerOptions
    estimate: MemoryEstimate
    priority: int = 0  # models.toml priority: higher is planned first
    held_since: float | None = None  # when a pass first held its swap for another model's queue
    tenant: str = ""  # the API key's name: slots are shared between tenants by weight
    share: float = 0.0  # its start tag in the weighted fair order (core.fairshare.FairShare.arrive)
    arrived: float = 0.0  # when it reached the scheduler (priority ages after max_extra_wait)
    #: its estimate at the smallest automatic context it may be made (None: it may not be made
    #: smaller): a size that would spill layers to system memory, or evict other models, where
    #: that one would not, fails with SmallerContextPreferred for the scheduler to try a smaller one
    floor_estimate: MemoryEstimate | None = None
    #: an adapter-model whose group's runner holds other models' adapters too: its estimate
    #: with only its own adapters (None otherwise): a group too large for the memory is served by
    #: runners of fewer adapters (``core.group_plan``)
    alone_estimate: MemoryEstimate | None = None
    #: the runner to load for it (None: :func:`trioshed.core.adapters.runner_model`'s)
    runner: ModelSpec | None = None

    @functools.cached_property
    def key(self) -> tuple[object, ...]:
        """What makes two requests interchangeable for the planner (same runner would serve)."""
        return (self.model.path, self.model.adapters, self.model.adapter_scales, self.model.projector, self.options)


@dataclass(frozen=True)
class Machine:
    """What the scheduler may use. ``gpus[i].free`` is the free memory the device *reports*
    (NVML) or its total (declared inventory); ``system`` is system memory (free = available)."""

    gpus: tuple[Device, ...]
    system: Device
    max_loaded: int
    overhead: int = 0
    spread: bool = False
    #: RPC servers that do not answer now (their last known size; ``name`` says why): placement
    #: leaves them out, and a model that would fit only with them gets a 503, not a 507.
    remote_down: tuple[Device, ...] = ()


Placer = Callable[..., Placement | DoesNotFit]


def default_max_loaded(configured: int, gpu_count: int) -> int:
    """TRIOSHED_MAX_LOADED_MODELS, where 0 means 3 per GPU (3 on CPU)."""
    return configured if configured > 0 else 3 * max(1, gpu_count)


def same_base(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs name the same base file in the same state (size, mtime) and projector:
    the files every model of an adapter group shares."""
    if a.base or b.base:  # adapter groups: one file, however each store names and dates it
        return (a.path, a.projector, a.base) == (b.path, b.projector, b.base)
    return (a.path, a.projector, a.size, a.modified) == (b.path, b.projector, b.size, b.modified)


def same_files(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether a runner of ``a`` (a runner's spec) applies ``b``'s files as ``b`` asks: the same
    base file and projector, and ``b``'s adapters among those it holds
    (:func:`trioshed.core.adapters.serves`)."""
    return same_base(a, b) and adapters.serves(a, b)


def can_serve(runner: RunnerView, model: ModelSpec, options: RunnerOptions) -> bool:
    """Whether ``runner`` can serve a request without a reload.

    Same base file (as it was when loaded: a file replaced since has another size or modification
    time, and is loaded again) and projector, holding the request's adapters (an adapter group's
    runner serves every member: :mod:`trioshed.core.adapters`); equal runner options, except that
    ``num_gpu < 0`` (auto) never forces a reload, a smaller ``num_ctx`` is served by a larger
    runner (ollama#6148), and a runner started for embeddings serves generation too (without the
    prompt cache it was started without).
    """
    if not same_base(runner.model, model) or not adapters.serves(runner.model, model, embedding=options.embedding):
        return False
    have, want = runner.options, options
    if have == want:
        return True  # the common case, without the copies below (a planning pass asks often)
    if have.embedding and not want.embedding:
        want = replace(want, embedding=True, cache_ram_mib=have.cache_ram_mib)  # an embedding runner generates too
    if want.num_gpu < 0:
        want = replace(want, num_gpu=have.num_gpu)
    if want.num_ctx <= have.num_ctx:
        want = replace(want, num_ctx=have.num_ctx)
    return have == want


def victim_order(runner: RunnerView) -> tuple[bool, float, float, int]:
    """Sort key for eviction: idle first, then the shortest keep-alive, the least recently used."""
    return (runner.leases > 0, runner.keep_alive, runner.last_used, runner.id)


def usage_of(placement: Placement) -> tuple[tuple[str, int], ...]:
    usage = dict(placement.vram)
    if placement.ram:
        usage[CPU_ID] = usage.get(CPU_ID, 0) + placement.ram
    return tuple(sorted(usage.items()))


def measured_usage(
    placement: Placement, measured: MeasuredMemory, backends: Sequence[str]
) -> tuple[tuple[str, int], ...] | None:
    """Bytes per device as llama.cpp reported allocating them (its ``-v`` buffer lines).

    ``backends`` are llama.cpp's names of ``placement.devices`` (``Vulkan0``, ``RPC0``). Host
    buffers (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``Vulkan_Host``, ``CUDA_Host``) are system
    memory. None when the report does not match the plan: a planned device with no buffer (a
    declared inventory, whose children run on the CPU) or a buffer on a device not planned.
    """
    names = dict(zip(backends, placement.devices, strict=True))
    usage: dict[str, int] = {}
    for name, n in measured.by_backend().items():
        if name.startswith("CPU") or name.endswith("_Host"):
            device = CPU_ID
        elif name in names:
            device = names[name]
        elif (base := name.partition("[")[0]) in names:  # "RPC0[10.0.0.2:50052]"
            device = names[base]
        else:
            return None
        usage[device] = usage.get(device, 0) + n
    if any(d not in usage for d in placement.devices):
        return None
    return tuple(sorted(usage.items()))
