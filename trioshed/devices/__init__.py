"""Device discovery: NVML through pynvml, else a declared inventory, else the CPU alone.

``discover()`` returns a :class:`DeviceSource`; ``poll()`` reports current free memory. With a
declared inventory (``TRIOSHED_DEVICES``) the scheduler accounts memory as if runners sat on
those devices while the children really run on the CPU (``accounting_only``): that is how
placement is tested on machines without GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import psutil

from trioshed.core.model import Device

log = logging.getLogger(__name__)


def system_memory() -> Device:
    vm = psutil.virtual_memory()
    return Device("cpu", "cpu", 0, vm.total, vm.available, name="system memory")


@dataclass
class DeviceSource:
    """The GPUs trioshed may use and how to read their free memory now."""

    gpus: tuple[Device, ...]
    kind: str  # "nvml", "declared" or "cpu"
    accounting_only: bool = False
    fixed_system: Device | None = None  # tests: a declared system memory instead of psutil's
    _handles: tuple[object, ...] = ()

    def poll(self) -> tuple[Device, ...]:
        """Current free memory per GPU (blocking but fast: a few NVML calls)."""
        if self.kind != "nvml":
            return self.gpus
        import pynvml

        polled = []
        for device, handle in zip(self.gpus, self._handles, strict=True):
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
    def recovers_vram(self) -> bool:
        """Whether freed memory must be polled for after an unload (real GPUs only)."""
        return self.kind == "nvml"


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


def discover(declared: tuple[Device, ...] | None = None) -> DeviceSource:
    """NVML when it initialises; else the declared inventory; else the CPU alone."""
    nvml = _nvml()
    if nvml is not None:
        return nvml
    if declared:
        return DeviceSource(declared, "declared", accounting_only=True)
    return DeviceSource((), "cpu")
