"""Device discovery: NVML through pynvml and Vulkan devices from the runner binary, else a
declared inventory, else the CPU alone.

``discover()`` returns a :class:`DeviceSource`; ``poll()`` reports current free memory (NVML
cards are polled; Vulkan devices keep what was free at start-up and are accounted from
trioshed's own reservations: :mod:`trioshed.devices.vulkan`). With a declared inventory
(``TRIOSHED_DEVICES``) the scheduler accounts memory as if runners sat on those devices while the
children really run on the CPU (``accounting_only``): that is how placement is tested on
machines without GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import psutil

from trioshed.core.model import Device
from trioshed.devices.vulkan import (
    HARDWARE_MAX_TENSOR,
    SOFTWARE_MAX_TENSOR,
    VULKAN_LIBRARY,
    ListedDevice,
    VulkanListing,
    list_runner_devices,
    same_card,
)

log = logging.getLogger(__name__)


def system_memory() -> Device:
    vm = psutil.virtual_memory()
    return Device("cpu", "cpu", 0, vm.total, vm.available, name="system memory")


@dataclass
class DeviceSource:
    """The GPUs trioshed may use and how to read their free memory now."""

    gpus: tuple[Device, ...]
    kind: str  # "nvml", "vulkan", "nvml+vulkan", "declared" or "cpu"
    accounting_only: bool = False
    fixed_system: Device | None = None  # tests: a declared system memory instead of psutil's
    _handles: tuple[object, ...] = ()  # per GPU: its NVML handle, or None (not polled)
    #: Added to every runner's environment (``GGML_VK_VISIBLE_DEVICES`` for software devices), so
    #: that runners number the Vulkan devices as discovery did.
    runner_env: tuple[tuple[str, str], ...] = ()

    def poll(self) -> tuple[Device, ...]:
        """Current free memory per GPU (blocking but fast: a few NVML calls)."""
        if not any(h is not None for h in self._handles):
            return self.gpus
        import pynvml

        polled = []
        for device, handle in zip(self.gpus, self._handles, strict=True):
            if handle is None:
                polled.append(device)
                continue
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                polled.append(replace(device, free=int(info.free), total=int(info.total)))
            except pynvml.NVMLError as exc:
                log.warning("NVML query of %s failed: %s", device.id, exc)
                polled.append(device)
        return tuple(polled)

    def system(self) -> Device:
        return self.fixed_system or system_memory()

    @property
    def max_tensor(self) -> int:
        """The smallest ``Device.max_tensor`` of the GPUs (0: none has a limit): the memory
        estimate is made before placement picks a device, so it assumes the strictest one."""
        return min((d.max_tensor for d in self.gpus if d.max_tensor), default=0)

    @property
    def recovers_vram(self) -> bool:
        """Whether freed memory must be polled for after an unload (real GPUs only)."""
        # NVML cards only; a runner on a Vulkan device beside them waits the recovery timeout out
        return self.kind.startswith("nvml")


def _nvml() -> DeviceSource | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        gpus, handles = [], []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            gpus.append(Device(f"cuda:{index}", "cuda", index, int(info.total), int(info.free), name=name))
            handles.append(handle)
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s): no NVIDIA GPU in use", exc)
        return None
    if not gpus:
        return None
    return DeviceSource(tuple(gpus), "nvml", _handles=tuple(handles))


def discover(
    declared: tuple[Device, ...] | None = None,
    *,
    binary: str | None = None,
    env: dict[str, str] | None = None,
    vulkan_software: bool = False,
) -> DeviceSource:
    """NVML cards and the Vulkan devices ``binary`` lists (each card once); else the declared
    inventory; else the CPU alone."""
    nvml = _nvml()
    listing = list_runner_devices(binary, env or {}, software=vulkan_software) if binary else None
    vulkan = list(listing.vulkan) if listing else []
    if nvml is not None:
        gpus, handles = list(nvml.gpus), list(nvml._handles)
        for i, card in enumerate(gpus):
            twin = next((d for d in vulkan if same_card(card.name, card.total, d)), None)
            if twin is None:
                continue
            vulkan.remove(twin)
            if listing is not None and not listing.has_cuda:  # a Vulkan-only build runs it as VulkanN
                gpus[i] = replace(card, id=f"{VULKAN_LIBRARY}:{twin.index}", library=VULKAN_LIBRARY,
                                  index=twin.index, max_tensor=vulkan_device(twin).max_tensor)  # fmt: skip
        gpus += [vulkan_device(d) for d in vulkan]
        handles += [None] * len(vulkan)
        kind = "nvml+vulkan" if vulkan else "nvml"
        return DeviceSource(tuple(gpus), kind, _handles=tuple(handles), runner_env=_env(listing))
    if vulkan:
        devices = tuple(vulkan_device(d) for d in vulkan)
        return DeviceSource(devices, "vulkan", _handles=(None,) * len(devices), runner_env=_env(listing))
    if declared:
        return DeviceSource(declared, "declared", accounting_only=True)
    return DeviceSource((), "cpu")


def vulkan_device(listed: ListedDevice) -> Device:
    """A listed Vulkan device as trioshed accounts it: its capacity is what was free when listed
    (see :mod:`trioshed.devices.vulkan`)."""
    return Device(
        f"{VULKAN_LIBRARY}:{listed.index}",
        VULKAN_LIBRARY,
        listed.index,
        total=listed.free,
        free=listed.free,
        name=listed.description,
        max_tensor=SOFTWARE_MAX_TENSOR if listed.software else HARDWARE_MAX_TENSOR,
    )


def _env(listing: VulkanListing | None) -> tuple[tuple[str, str], ...]:
    return listing.env if listing is not None else ()
