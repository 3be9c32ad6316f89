"""Vulkan GPUs (AMD, Intel; NVIDIA too) as the runner binary itself lists them.

The bundled llama.cpp build is a Vulkan build, so the devices it can use are the ones
``llama-server --list-devices`` prints (``Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB,
23871 MiB free)``): asking the binary, not a Vulkan library of our own, gives the names and the
numbering that ``--device VulkanN`` expects, under the same environment the runners get.

Software devices
    llama.cpp's Vulkan backend leaves out CPU-type devices (Mesa's lavapipe, "llvmpipe") unless
    ``GGML_VK_VISIBLE_DEVICES`` names them. With ``TRIOSHED_VULKAN_SOFTWARE=1`` (tests, CI)
    trioshed finds every physical device's index (one probe per index until llama.cpp calls one
    invalid) and sets ``GGML_VK_VISIBLE_DEVICES`` to all of them, for the probe and for every
    runner alike. Without it, a device whose name says it is a software renderer is ignored even
    when the user's own ``GGML_VK_VISIBLE_DEVICES`` shows it.

Free memory
    Read once, at start-up. A driver with ``VK_EXT_memory_budget`` reports what is free then; one
    without (lavapipe) reports its whole heap as free, and that number never moves. Either way
    trioshed then accounts from its own reservations: the device's capacity (``Device.total``) is
    what was free at start-up, and the scheduler subtracts what its runners hold. Memory that other
    programs take later is not seen (NVML, where present, is polled instead: see below).

NVIDIA cards
    NVML sees them too. A Vulkan device is the same card as an NVML one when its name contains the
    NVML name (both come from the driver: "NVIDIA GeForce RTX 4090") and its total memory is within
    :data:`SAME_CARD_TOLERANCE` of NVML's (Vulkan reports the device-local heap, NVML the board's
    memory); cards are paired in order. A paired card is counted once, polled through NVML, and
    launched as ``VulkanN`` when the binary lists no CUDA device (a Vulkan-only build).
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from trioshed.core.model import GiB, MiB

log = logging.getLogger(__name__)

VULKAN_LIBRARY = "vulkan"
LIST_TIMEOUT = 30.0
MAX_DEVICES = 16  # GGML_VK_MAX_DEVICES
SAME_CARD_TOLERANCE = 0.10
VISIBLE = "GGML_VK_VISIBLE_DEVICES"
#: The largest tensor lavapipe takes (its ``maxStorageBufferRange``, llvmpipe's 2**27): llama.cpp's
#: Vulkan backend refuses any op with a bigger tensor (``supports_op``), so a bigger weight stays on
#: the CPU (measured: gemma3-270m's 170 MiB tied output) and so does attention whose scores are
#: bigger (gemma3-270m at 32,768 cells without flash attention: 256 MiB; see core/estimate.py).
SOFTWARE_MAX_TENSOR = 128 * MiB
#: The limit assumed for hardware drivers: ``maxStorageBufferRange`` is a 32-bit number, so at
#: most 4 GiB (desktop drivers commonly report that), and llama-server's listing says neither the
#: driver's value nor whether its 64-bit indexing lifts it. Counting a bigger tensor's work in
#: system memory keeps the estimate from falling under on the host side.
HARDWARE_MAX_TENSOR = 4 * GiB - 1

_LINE = re.compile(r"^\s*([A-Za-z_]+?)(\d+)\s*:\s*(.*?)\s*\((\d+) MiB, (\d+) MiB free\)\s*$")
_SOFTWARE = re.compile(r"llvmpipe|lavapipe|swiftshader|softpipe", re.IGNORECASE)


@dataclass(frozen=True)
class ListedDevice:
    """One local device line of ``--list-devices``: backend (``"Vulkan"``), index, description."""

    backend: str
    index: int
    description: str
    total: int
    free: int

    @property
    def name(self) -> str:
        """llama.cpp's name for it: ``Vulkan0``."""
        return f"{self.backend}{self.index}"

    @property
    def software(self) -> bool:
        """A CPU implementing Vulkan (lavapipe): no memory or speed of its own."""
        return bool(_SOFTWARE.search(self.description))


def parse_devices(text: str) -> list[ListedDevice]:
    """Every device line of ``llama-server --list-devices`` output (RPC ones included)."""
    out = []
    for line in text.splitlines():
        if m := _LINE.match(line):
            out.append(ListedDevice(m[1], int(m[2]), m[3], int(m[4]) * MiB, int(m[5]) * MiB))
    return out


def run_list_devices(binary: str, env: Mapping[str, str]) -> str:
    """``llama-server --list-devices`` under ``env``: its output ('' when it cannot run)."""
    try:
        done = subprocess.run(
            [binary, "--list-devices"],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=LIST_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot list the runner's devices (%s --list-devices): %s", binary, exc)
        return ""
    return (done.stdout + done.stderr).decode("utf-8", "replace")


@dataclass(frozen=True)
class VulkanListing:
    """What the runner binary can use: its local devices, and the environment to run it with."""

    devices: tuple[ListedDevice, ...]  # every local device listed (Vulkan, CUDA, ...)
    env: tuple[tuple[str, str], ...] = ()  # added to every runner's environment

    @property
    def vulkan(self) -> tuple[ListedDevice, ...]:
        return tuple(d for d in self.devices if d.backend == "Vulkan")

    @property
    def has_cuda(self) -> bool:
        return any(d.backend == "CUDA" for d in self.devices)


#: Variables that change what the binary lists: the cache key of :func:`list_runner_devices`.
_LISTING_VARIABLES = (VISIBLE, "VK_ICD_FILENAMES", "VK_DRIVER_FILES", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")
_listings: dict[tuple[object, ...], VulkanListing] = {}


def list_runner_devices(binary: str, env: Mapping[str, str], *, software: bool = False) -> VulkanListing:
    """The local devices ``binary`` lists, software Vulkan devices only when ``software``.

    Cached per binary, setting and the variables that change the answer: a process (a server,
    a test session) lists them once (~0.1-0.5 s per ``--list-devices``).
    """
    key = (binary, software, *((k, env.get(k)) for k in _LISTING_VARIABLES))
    if key not in _listings:
        _listings[key] = _list(binary, env, software)
    return _listings[key]


def _list(binary: str, env: Mapping[str, str], software: bool) -> VulkanListing:
    extra: dict[str, str] = {}
    if software and VISIBLE not in env:
        indices = _physical_indices(binary, env)
        if indices:
            extra[VISIBLE] = ",".join(map(str, indices))
    text = run_list_devices(binary, {**env, **extra})
    kept = []
    for d in parse_devices(text):
        if d.backend == "RPC":
            continue
        if d.backend == "Vulkan" and d.software and not software:
            log.info("ignoring software Vulkan device %s (%s); TRIOSHED_VULKAN_SOFTWARE=1 uses it",
                     d.name, d.description)  # fmt: skip
            continue
        kept.append(d)
    return VulkanListing(tuple(kept), tuple(extra.items()))


def _physical_indices(binary: str, env: Mapping[str, str]) -> list[int]:
    """Every Vulkan physical device's index: llama.cpp lists a device named in
    ``GGML_VK_VISIBLE_DEVICES`` whatever its type, and lists nothing for an invalid index."""
    found = []
    for index in range(MAX_DEVICES):
        text = run_list_devices(binary, {**env, VISIBLE: str(index)})
        if not any(d.backend == "Vulkan" for d in parse_devices(text)):
            break
        found.append(index)
    return found


def same_card(nvml_name: str, nvml_total: int, device: ListedDevice) -> bool:
    """Whether a Vulkan device is the card NVML reports as ``nvml_name`` with ``nvml_total``."""
    if not nvml_name or nvml_name.lower() not in device.description.lower():
        return False
    return abs(device.total - nvml_total) <= SAME_CARD_TOLERANCE * max(nvml_total, 1)
