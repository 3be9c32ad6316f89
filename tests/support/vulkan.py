"""Session fixtures for tests on a real Vulkan device (lavapipe in CI: ``mesa-vulkan-drivers``).

``vulkan_device`` discovers the devices exactly as the server does with
``TRIOSHED_VULKAN_SOFTWARE=1`` and skips, saying why, when there is none. It first points Mesa's
shader cache at a folder of this session's pytest tmp: lavapipe compiles llama.cpp's shaders on a
graph's first run (~15 s for a tiny model's, longer for gemma3's), and the cache keeps that to once
per test session, never carried over from an earlier run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from trioshed.core.model import Device
from trioshed.devices import discover
from trioshed.runner.binary import BinaryNotFound, find_llama_server


@pytest.fixture(scope="session")
def vulkan_shader_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = str(tmp_path_factory.mktemp("mesa-shader-cache"))
    before = os.environ.get("MESA_SHADER_CACHE_DIR")
    os.environ["MESA_SHADER_CACHE_DIR"] = folder
    yield folder
    if before is None:
        os.environ.pop("MESA_SHADER_CACHE_DIR", None)
    else:
        os.environ["MESA_SHADER_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def vulkan_device(vulkan_shader_cache: str) -> tuple[Device, dict[str, str]]:
    """The first Vulkan device (software ones included) and the runner environment for it."""
    try:
        binary = find_llama_server()
    except BinaryNotFound as exc:
        pytest.skip(f"no llama-server: {exc}")
    source = discover(binary=binary.path, env=binary.env, vulkan_software=True)
    vulkan = [d for d in source.gpus if d.library == "vulkan"]
    if not vulkan:
        pytest.skip(
            "no Vulkan device: llama-server --list-devices lists none (install a Vulkan driver, "
            "e.g. Debian's mesa-vulkan-drivers for lavapipe, as .ci/run does)"
        )
    return vulkan[0], {**binary.env, **dict(source.runner_env)}
