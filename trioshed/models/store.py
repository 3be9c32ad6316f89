"""The model store: a folder of ``*.gguf`` files, optionally described further by ``models.toml``.

Each ``NAME.gguf`` is model ``NAME:latest`` (``NAME`` resolves too). ``models.toml`` may add
entries with aliases, adapters, a projector, default options and scheduling settings (see
``trioshed.models.catalogue`` for every key)::

    [models."mistral-lora"]
    path = "mistral-7b.gguf"          # relative to the store folder
    adapters = ["my-lora.gguf"]
    options = { num_ctx = 8192, temperature = 0.2 }
    pinned = true

The folder is re-read on each lookup (a stat per file: cheap), so models copied in while
trioshed runs appear at once; ``models.toml`` is re-parsed when its size or mtime changes
(or on :meth:`ModelStore.reload`), and its problems are logged each time it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat as stat_module
from dataclasses import dataclass
from pathlib import Path

from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, Forbidden, ModelNotFound
from trioshed.models.catalogue import Catalogue, Entry, load_catalogue
from trioshed.models.names import is_name_part, split_name

log = logging.getLogger(__name__)


@dataclass
class _DigestCacheEntry:
    key: tuple[int, int]
    digest: str


class ModelStore:
    """Resolves model names to :class:`ModelSpec` and lists what the folder holds."""

    def __init__(self, root: Path, *, allow_symlinks: bool = False) -> None:
        self.root = Path(root)
        self.allow_symlinks = allow_symlinks
        self._digests: dict[str, _DigestCacheEntry] = {}
        self._catalogue: tuple[tuple[int, int, int] | None, Catalogue] | None = None

    def _inside(self, file: Path) -> bool:
        """Whether ``file`` (in the store folder) really lies in it: a symlink pointing out of the
        store is followed only with TRIOSHED_ALLOW_SYMLINKS (models.toml can name any path)."""
        if self.allow_symlinks:
            return True
        try:
            if file.parent == self.root and not file.is_symlink():
                return (
                    True  # a file right in the folder, not a link: where the folder is (one lstat)
                )
            return file.resolve().is_relative_to(self.root.resolve())
        except OSError:
            return False

    @property
    def toml_path(self) -> Path:
        return self.root / "models.toml"

    def _toml_key(self) -> tuple[int, int, int] | None:
        try:
            st = self.toml_path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def catalogue(self) -> Catalogue:
        """``models.toml`` as last parsed; re-parsed (and its problems logged) when it changed."""
        cached = self._catalogue
        if cached is not None and cached[0] == self._toml_key():
            return cached[1]
        return self.reload()

    def reload(self) -> Catalogue:
        """Parse ``models.toml`` now (e.g. on SIGHUP) and log every problem in it, one warning
        each. Running runners keep the settings they were loaded with."""
        key = self._toml_key()  # before reading: a change in between is seen next time
        catalogue = load_catalogue(self.toml_path, self.root)
        for problem in catalogue.problems:
            log.warning("%s", problem)
        self._catalogue = (key, catalogue)
        return catalogue

    def _spec_from_file(
        self, full_name: str, path: Path, stat: os.stat_result | None = None, **extra: object
    ) -> ModelSpec:
        stat = stat or path.stat()
        return ModelSpec(
            name=full_name, path=str(path), size=stat.st_size, modified=stat.st_mtime, **extra  # type: ignore[arg-type]
        )

    def _spec_from_entry(self, entry: Entry, name: str) -> ModelSpec:
        for what, path in (("path", entry.path), *(("adapter", a) for a in entry.adapters),
                           *((("projector", entry.projector),) if entry.projector else ())):  # fmt: skip
            if not Path(path).is_file():
                raise BadRequest(f"models.toml: {what} {path!r} of model '{name}' does not exist")
        return self._spec_from_file(
            name,
            Path(entry.path),
            adapters=entry.adapters,
            projector=entry.projector,
            defaults=entry.options,
            num_parallel=entry.num_parallel,
            keep_alive=entry.keep_alive,
            pinned=entry.pinned,
            priority=entry.priority,
            args=entry.args,
            system=entry.system,
            speculation=entry.speculation,
            draft=entry.draft,
        )

    def resolve(self, name: str) -> ModelSpec:
        base, tag = split_name(name)
        full = f"{base}:{tag}"
        entry = self.catalogue().lookup(full)
        if entry is not None:
            return self._spec_from_entry(entry, full)
        if tag != "latest":
            raise ModelNotFound(name)
        file = self.root / f"{base}.gguf"
        try:
            found = file.stat()
        except (OSError, ValueError):
            raise ModelNotFound(name) from None
        if not stat_module.S_ISREG(found.st_mode):
            raise ModelNotFound(name)
        if not self._inside(file):
            raise Forbidden(
                f"model '{name}' is a symlink to a file outside the model store; name that file in "
                "models.toml, or set TRIOSHED_ALLOW_SYMLINKS=1 to follow such links"
            )
        return self._spec_from_file(full, file, found)

    def links_out(self) -> list[Path]:
        """``*.gguf`` symlinks pointing out of the store: not served unless TRIOSHED_ALLOW_SYMLINKS."""
        if not self.root.is_dir():
            return []
        return [p for p in sorted(self.root.glob("*.gguf")) if p.is_symlink() and not self._inside(p)]

    def list(self) -> list[ModelSpec]:
        specs: dict[str, ModelSpec] = {}
        try:
            with os.scandir(self.root) as found:
                entries = sorted((e for e in found if e.name.endswith(".gguf")), key=lambda e: e.name)
        except OSError:  # no folder (yet), or not one
            entries = []
        # One stat per file: a store of thousands lists in milliseconds (the glob, the
        # is_file and two resolves per file were ~17 system calls each).
        for found_file in entries:
            stem = found_file.name[: -len(".gguf")]
            if not is_name_part(stem):
                continue
            try:
                st = found_file.stat()  # follows a symlink
            except OSError:
                continue  # a dangling link, or gone since
            if not stat_module.S_ISREG(st.st_mode) or (found_file.is_symlink() and not self._inside(Path(found_file.path))):
                continue
            name = f"{stem}:latest"
            specs[name] = ModelSpec(name=name, path=found_file.path, size=st.st_size, modified=st.st_mtime)
        for name, entry in self.catalogue().names.items():  # entries and their aliases
            try:
                specs[name] = self._spec_from_entry(entry, name)
            except BadRequest:
                continue  # its file is missing: reported when models.toml was read
        return sorted(specs.values(), key=lambda s: s.name)

    def digest(self, spec: ModelSpec) -> str:
        """sha256 of the GGUF file, cached by (size, mtime). Blocking: call in a thread."""
        stat = Path(spec.path).stat()
        key = (stat.st_size, stat.st_mtime_ns)
        cached = self._digests.get(spec.path)
        if cached and cached.key == key:
            return cached.digest
        h = hashlib.sha256()
        with open(spec.path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = h.hexdigest()
        self._digests[spec.path] = _DigestCacheEntry(key, digest)
        return digest

    def cached_digest(self, spec: ModelSpec) -> str | None:
        cached = self._digests.get(spec.path)
        return cached.digest if cached else None
