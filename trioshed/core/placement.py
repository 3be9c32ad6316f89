"""Decide where a runner goes: which GPUs, how many layers, and the bytes on each device.

Pure: a :class:`~trioshed.core.model.MemoryEstimate`, the GPUs' free memory and the system's free
memory in; a :class:`~trioshed.core.model.Placement` or a
:class:`~trioshed.core.model.DoesNotFit` out.

Layer counting follows llama.cpp's ``-ngl``: the repeating layers are 0..n_layer-1 and the output
layer counts as layer ``n_layer``, so ``n_gpu_layers = n_layer + 1`` offloads everything and
``n_gpu_layers = k <= n_layer`` puts the output layer and the last ``k - 1`` repeating layers on
the GPUs (the rule of the pinned build, b10068: ``-ngl 1`` logs "offloading output layer to GPU,
offloading 0 repeating layers"; checked per device against the real build over RPC servers in
``tests/e2e/test_rpc_e2e.py``). The input layer (``token_embd``) is always in system memory.

With several GPUs llama.cpp assigns offloaded layer r (0-based among the offloaded ones, the
output layer last) to the first device whose cumulative ``tensor_split`` fraction exceeds
``r / n_offloaded``; :func:`split_layers` reproduces that rule, so the bytes predicted per device
are the ones llama.cpp will allocate.

Order of preference (Ollama's): CPU only when asked (``num_gpu=0``) or without GPUs; else one
GPU that holds everything, the one with the most free memory; else all GPUs of one library with
layers split in proportion to their free memory; else partial offload, the most layers that fit;
else the model does not fit. ``spread`` skips the single-GPU step.

"Would it fit if nothing else were loaded?" is :func:`capacity`: ``place()`` over the devices'
totals.

Remote devices (llama.cpp RPC servers, ``Device.is_remote``) come last: only when the local
placement would not put every wanted layer on local GPUs (or, on a machine without GPUs, when the
model does not fit in system memory) does :func:`place` span them. A span fills the local GPUs
first and gives the RPC servers only the layers that are left, using as few servers as it can
(the ones with the most free memory first); its ``tensor_split`` is the layer count per device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from trioshed.core.model import Device, DoesNotFit, MemoryEstimate, Placement

__all__ = ["capacity", "gpu_layer_count", "place", "split_layers"]


def gpu_layer_count(est: MemoryEstimate) -> int:
    """``-ngl`` for full offload: the repeating layers plus the output layer."""
    return len(est.layers) + 1


def split_layers(n_layer: int, n_gpu_layers: int, fractions: Sequence[float]) -> list[list[int]]:
    """Which layers (output layer = ``n_layer``) llama.cpp puts on each device for ``-ngl``.

    ``fractions`` are ``--tensor-split`` weights (any scale). Mirrors ``llama_model::load_tensors``
    (b10068): offloaded layers are ``[n_layer + 1 - ngl, n_layer]`` clipped at 0, and layer il goes
    to the first device whose cumulative normalised split exceeds ``(il - start) / act``.
    """
    n_dev = len(fractions)
    out: list[list[int]] = [[] for _ in range(n_dev)]
    total = float(sum(fractions))
    if n_dev == 0 or total <= 0 or n_gpu_layers <= 0:
        return out
    cumulative = []
    acc = 0.0
    for f in fractions:
        acc += f
        cumulative.append(acc / total)
    start = max(n_layer + 1 - n_gpu_layers, 0)
    act = n_layer + 1 - start
    for il in range(start, n_layer + 1):
        dev = bisect.bisect_right(cumulative, (il - start) / act)
        out[min(dev, n_dev - 1)].append(il)
    return out


def _layer_bytes(est: MemoryEstimate, il: int, device: Device | None = None) -> int:
    if il != len(est.layers):
        return est.layers[il]
    return est.output - _output_left_on_host(est, device)


def _output_left_on_host(est: MemoryEstimate, device: Device | None) -> int:
    """Bytes of the output layer that stay in system memory on ``device`` (its largest tensor,
    when the device takes no tensor that big: ``Device.max_tensor``)."""
    if device is None or not device.max_tensor or est.output_tensor <= device.max_tensor:
        return 0
    return est.output_tensor


def _cpu_ram(
    est: MemoryEstimate, n_gpu_layers: int, output_device: Device | None = None, draft_gpu: Device | None = None
) -> int:
    """System memory with ``n_gpu_layers`` offloaded: input layer, CPU layers, host compute,
    and llama-server's prompt cache (host memory whatever ``-ngl`` says).

    Measured on Vulkan (b10068): with any layer on a GPU the CPU backend computes in the GPU's
    host buffer (``Vulkan_Host compute``: inputs and masks, the big products of CPU layers run
    on the GPU) and keeps no repacked weights (no ``CPU_REPACK`` buffer). An estimate without
    GPU figures (``host_compute_partial`` None) keeps the CPU ones.
    """
    n_layer = len(est.layers)
    if n_gpu_layers <= 0:
        return est.cpu_total
    draft = 0  # a draft model: its host side on ``draft_gpu``, or all of it in system memory
    if est.draft is not None:
        d = est.draft
        draft = _cpu_ram(d, len(d.layers) + 1, draft_gpu) if draft_gpu is not None else d.cpu_total
    on_cpu = max(n_layer + 1 - n_gpu_layers, 0)  # repeating layers left on the CPU
    ram = est.token_embd + est.prompt_cache + sum(est.layers[:on_cpu]) + est.host_compute(full=not on_cpu)
    if est.host_compute_partial is None and n_layer:
        ram += est.cpu_repack * on_cpu // n_layer
    left = _output_left_on_host(est, output_device)
    return ram + max(0, left - est.output_shared) + draft  # a tied copy left on the host is the mapped one


def _gpu_vram(
    est: MemoryEstimate, gpus: Sequence[Device], n_gpu_layers: int, fractions: Sequence[float]
) -> list[int]:
    """Bytes on each GPU: its layers, its compute buffer, and projector/adapters on the first."""
    n_layer = len(est.layers)
    compute = est.gpu_compute(full=n_gpu_layers > n_layer)
    assigned = split_layers(n_layer, n_gpu_layers, fractions)
    vram = []
    for i, layers in enumerate(assigned):
        if not layers and i != 0:
            vram.append(0)
            continue
        b = sum(_layer_bytes(est, il, gpus[i]) for il in layers) + compute
        if i == 0:
            b += est.projector + est.adapters
        vram.append(b)
    return vram


def _output_device(
    est: MemoryEstimate, gpus: Sequence[Device], n_gpu_layers: int, fractions: Sequence[float]
) -> Device | None:
    """The GPU that llama.cpp gives the output layer (None: it stays on the CPU)."""
    n_layer = len(est.layers)
    for device, layers in zip(gpus, split_layers(n_layer, n_gpu_layers, fractions), strict=True):
        if n_layer in layers:
            return device
    return None


def _usable(d: Device, overhead: int) -> int:
    return max(0, d.free - overhead)


def _try(
    est: MemoryEstimate,
    gpus: Sequence[Device],
    n_gpu_layers: int,
    *,
    system_free: int,
    overhead: int,
) -> Placement | None:
    """``n_gpu_layers`` over ``gpus`` split by usable memory, if every device has room."""
    if n_gpu_layers <= 0 or not gpus:
        ram = _cpu_ram(est, 0)
        return Placement(n_gpu_layers=0, ram=ram) if ram <= system_free else None
    usable = [_usable(d, overhead) for d in gpus]
    if len(gpus) > 1:
        # Proportional to what is left after each device's compute buffer: the bytes the layers
        # can really use.
        compute = est.gpu_compute(full=n_gpu_layers > len(est.layers))
        room = [max(u - compute, 0) for u in usable]
        if sum(room) <= 0:
            return None
        # The split is computed from the rounded fractions that go on the command line, so the
        # layers predicted per device are the ones llama.cpp will assign.
        fractions: list[float] = [round(r / sum(room), 4) for r in room]
    else:
        fractions = [1.0]
    vram = _gpu_vram(est, gpus, n_gpu_layers, fractions)
    draft_gpu = _draft_device(est, gpus, n_gpu_layers)
    if draft_gpu is not None and est.draft is not None:
        vram[0] += _gpu_vram(est.draft, [draft_gpu], len(est.draft.layers) + 1, [1.0])[0]
    if any(v > u for v, u in zip(vram, usable, strict=True)):
        return None
    ram = _cpu_ram(est, n_gpu_layers, _output_device(est, gpus, n_gpu_layers, fractions), draft_gpu)
    if ram > system_free:
        return None
    used = [(d, v) for d, v in zip(gpus, vram, strict=True) if v > 0]
    multi = len(gpus) > 1
    return Placement(
        n_gpu_layers=n_gpu_layers,
        devices=tuple(d.id for d in gpus),
        tensor_split=tuple(fractions) if multi else None,
        main_gpu=0 if multi else None,
        vram=tuple((d.id, v) for d, v in used),
        ram=ram,
        draft_device=draft_gpu.id if draft_gpu is not None else None,
    )


def _draft_device(est: MemoryEstimate, gpus: Sequence[Device], n_gpu_layers: int) -> Device | None:
    """Where a draft model goes: with every target layer on local GPUs, all of the draft on the
    first of them (where ``--device-draft`` puts it); otherwise system memory (None), where it
    takes no GPU memory a target layer could use."""
    if est.draft is None or not gpus or n_gpu_layers <= len(est.layers) or gpus[0].is_remote:
        return None
    return gpus[0]


def _libraries(gpus: Sequence[Device]) -> list[list[Device]]:
    """GPUs grouped by library, each group by index, groups with the most free memory first."""
    groups: dict[str, list[Device]] = {}
    for d in gpus:
        groups.setdefault(d.library, []).append(d)
    ordered = [sorted(g, key=lambda d: d.index) for g in groups.values()]
    ordered.sort(key=lambda g: -sum(d.free for d in g))
    return ordered


def place(
    est: MemoryEstimate,
    devices: Sequence[Device],
    *,
    system_free: int,
    num_gpu: int = -1,
    spread: bool = False,
    overhead: int = 0,
) -> Placement | DoesNotFit:
    """Where to run a model needing ``est``.

    ``devices`` are GPUs (CPU entries are ignored) whose ``free`` already excludes the loaded
    runners; ``overhead`` bytes are kept free on each. ``system_free`` is the system memory
    available to this runner. ``num_gpu``: -1 automatic, 0 CPU only, N exactly
    ``min(N, n_layer + 1)`` layers (N counts the output layer as layer ``n_layer``).
    Remote devices (RPC servers) are used only when the local ones are not enough (module doc).
    """
    local = [d for d in devices if not d.is_cpu and not d.is_remote]
    remote = [d for d in devices if d.is_remote]
    result = _place_local(
        est, local, system_free=system_free, num_gpu=num_gpu, spread=spread, overhead=overhead
    )
    if not remote or num_gpu == 0:
        return result
    wanted = min(num_gpu, gpu_layer_count(est)) if num_gpu > 0 else gpu_layer_count(est)
    if isinstance(result, Placement) and (result.n_gpu_layers >= wanted or not local):
        return result  # local GPUs hold every wanted layer, or a GPU-less machine holds the model
    span = _span(est, local, remote, wanted, system_free=system_free, overhead=overhead)
    if span is not None:
        return span
    if num_gpu < 0:
        partial = _span_partial(est, local, remote, wanted, system_free=system_free, overhead=overhead)
        if partial is not None and (
            not isinstance(result, Placement) or partial.n_gpu_layers > result.n_gpu_layers
        ):
            return partial
    if isinstance(result, Placement):
        return result
    room = sum(_usable(d, overhead) for d in (*local, *remote))
    return DoesNotFit(
        needed=est.total,
        available=max(room, system_free),
        reason=f"{result.reason}; with the RPC servers ({', '.join(d.endpoint for d in remote)}) "
        f"the devices have {_gib(room)} free and no split of layers fits",
    )


def _offloaded(n_layer: int, n_gpu_layers: int) -> list[int]:
    """The layers ``-ngl`` offloads, in device-assignment order (the rule of :func:`split_layers`)."""
    return list(range(max(n_layer + 1 - n_gpu_layers, 0), n_layer + 1))


def _fill(
    est: MemoryEstimate, devices: Sequence[Device], n_gpu_layers: int, overhead: int
) -> list[int] | None:
    """Layers per device, filling each in order before the next; None when they do not fit."""
    n_layer = len(est.layers)
    compute = est.gpu_compute(full=n_gpu_layers > n_layer)
    counts = [0] * len(devices)
    i = 0
    room = _usable(devices[0], overhead) - compute - est.projector - est.adapters
    for il in _offloaded(n_layer, n_gpu_layers):
        need = _layer_bytes(est, il, devices[i])
        while need > room:
            i += 1
            if i == len(devices):
                return None
            room = _usable(devices[i], overhead) - compute
            need = _layer_bytes(est, il, devices[i])
        counts[i] += 1
        room -= need
    return counts


def _span_with(
    est: MemoryEstimate,
    devices: Sequence[Device],
    n_gpu_layers: int,
    *,
    system_free: int,
    overhead: int,
) -> Placement | None:
    """``n_gpu_layers`` over ``devices`` filled in order; devices left empty are dropped."""
    devices = list(devices)
    counts: list[int] | None = None
    while devices:
        counts = _fill(est, devices, n_gpu_layers, overhead)
        if counts is None:
            return None
        if all(counts):
            break
        devices = [d for d, c in zip(devices, counts, strict=True) if c]
    if counts is None or not devices or not any(d.is_remote for d in devices):
        return None
    fractions = [float(c) for c in counts]
    ram = _cpu_ram(est, n_gpu_layers, _output_device(est, devices, n_gpu_layers, fractions))
    if ram > system_free:
        return None
    vram = _gpu_vram(est, devices, n_gpu_layers, fractions)
    if any(v > _usable(d, overhead) for d, v in zip(devices, vram, strict=True)):
        return None  # the fill and llama.cpp's split rule disagree: never place on a guess
    return Placement(
        n_gpu_layers=n_gpu_layers,
        devices=tuple(d.id for d in devices),
        tensor_split=tuple(fractions),
        main_gpu=0,
        vram=tuple((d.id, v) for d, v in zip(devices, vram, strict=True)),
        ram=ram,
        layers=tuple(counts),
    )


def _local_first(local: Sequence[Device], overhead: int) -> list[Device]:
    """The local GPUs a span fills first: the library group with the most memory, fullest first."""
    if not local:
        return []
    return sorted(_libraries(local)[0], key=lambda d: (-_usable(d, overhead), d.index))


def _span(
    est: MemoryEstimate,
    local: Sequence[Device],
    remote: Sequence[Device],
    wanted: int,
    *,
    system_free: int,
    overhead: int,
) -> Placement | None:
    """All ``wanted`` layers over the local GPUs and as few RPC servers as possible."""
    first = _local_first(local, overhead)
    by_free = sorted(remote, key=lambda d: (-_usable(d, overhead), d.index))
    for k in range(1, len(by_free) + 1):
        chosen = by_free[:k]
        # The last device also takes the output layer, often the largest: the chosen servers
        # are tried largest first, then largest last.
        for order in (chosen, chosen[::-1]) if k > 1 else (chosen,):
            p = _span_with(est, [*first, *order], wanted, system_free=system_free, overhead=overhead)
            if p is not None:
                return p
    return None


def _span_partial(
    est: MemoryEstimate,
    local: Sequence[Device],
    remote: Sequence[Device],
    wanted: int,
    *,
    system_free: int,
    overhead: int,
) -> Placement | None:
    """The most layers that fit on the local GPUs and every RPC server, the rest on the CPU."""
    devices = [*_local_first(local, overhead), *sorted(remote, key=lambda d: (-_usable(d, overhead), d.index))]
    for n in range(wanted - 1, 0, -1):
        p = _span_with(est, devices, n, system_free=system_free, overhead=overhead)
        if p is not None:
            return p
    return None


def _place_local(
    est: MemoryEstimate,
    gpus: Sequence[Device],
    *,
    system_free: int,
    num_gpu: int = -1,
    spread: bool = False,
    overhead: int = 0,
) -> Placement | DoesNotFit:
    """:func:`place` over local devices only (Ollama's order, module doc)."""
    n_full = gpu_layer_count(est)
    if num_gpu == 0 or not gpus:
        p = _try(est, (), 0, system_free=system_free, overhead=overhead)
        if p is not None:
            return p
        where = "CPU only (num_gpu=0)" if num_gpu == 0 else "no GPU"
        return DoesNotFit(
            needed=est.cpu_total,
            available=system_free,
            reason=f"{where}: needs {_gib(est.cpu_total)} of system memory, {_gib(system_free)} free",
        )

    wanted = min(num_gpu, n_full) if num_gpu > 0 else n_full
    by_free = sorted(gpus, key=lambda d: (-_usable(d, overhead), d.index))
    if not spread:
        for d in by_free:
            p = _try(est, (d,), wanted, system_free=system_free, overhead=overhead)
            if p is not None:
                return p
    groups = _libraries(gpus)
    for group in groups:
        if spread or len(group) > 1:
            p = _try(est, group, wanted, system_free=system_free, overhead=overhead)
            if p is not None:
                return p
    if num_gpu > 0:
        best_gpu = _usable(by_free[0], overhead)
        return DoesNotFit(
            needed=est.total,
            available=max(best_gpu, sum(_usable(d, overhead) for d in groups[0])),
            reason=f"num_gpu={num_gpu}: {wanted} layers do not fit on the GPUs "
            f"(or the rest in {_gib(system_free)} of system memory)",
        )

    # Partial offload: the most layers that fit, on the library group with the most memory (or
    # the single best GPU when that holds more layers).
    candidates: list[Sequence[Device]] = [groups[0], (by_free[0],)]
    best: Placement | None = None
    for cand in candidates:
        for n in range(n_full - 1, -1, -1):
            p = _try(est, cand, n, system_free=system_free, overhead=overhead)
            if p is not None:
                if best is None or p.n_gpu_layers > best.n_gpu_layers:
                    best = p
                break
    if best is not None:
        return best
    gpu_room = max(sum(_usable(d, overhead) for d in g) for g in groups)
    return DoesNotFit(
        needed=est.total,
        available=max(gpu_room, system_free),
        reason=(
            f"needs {_gib(est.total)}; the GPUs have {_gib(gpu_room)} free and system memory "
            f"{_gib(system_free)}, and no split of layers between them fits"
        ),
    )


def capacity(
    est: MemoryEstimate,
    devices_total: Sequence[Device],
    *,
    system_total: int,
    num_gpu: int = -1,
    spread: bool = False,
    overhead: int = 0,
) -> Placement | DoesNotFit:
    """Would ``est`` fit with nothing else loaded? ``place()`` with every device's free = total."""
    empty = [replace(d, free=d.total) for d in devices_total if not d.is_cpu]
    return place(
        est, empty, system_free=system_total, num_gpu=num_gpu, spread=spread, overhead=overhead
    )


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
