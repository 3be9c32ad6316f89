"""The model store: a folder of ``*.gguf`` files, optionally described further by ``models.toml``.

Each ``NAME.gguf`` is model ``NAME:latest`` (``NAME`` resolves too). ``models.toml`` may add
entries with aliases, adapters, a projector, default options and scheduling settings (see
``trioshed.models.catalogue`` for every key)::

    [models."mistral-lora"]
    path = "mistral-7b.gguf"          # relative to the store folder
    adapters = ["my-lora.gguf"]
    options = { num_ctx = 8192, temperature = 0.2 }
    pinned = true

Multimodal projectors (``mmproj``) are never models: they pair with their model on their own
where that is unambiguous (:mod:`trioshed.models.projectors`), in the store folder or in a
sub-folder holding one model (llama.cpp's router layout: the model is named after the folder);
``models.toml``'s ``projector =`` wins, and an ambiguous folder is logged and said in
``/api/show``.

The folder is re-read on each lookup (a stat per file: cheap), so models copied in while
trioshed runs appear at once; ``models.toml`` is re-parsed when its size or mtime changes
(or on :meth:`ModelStore.reload`), and its problems are logged each time it is.

A lookup, the listing and hashing work on paths as strings (``os.path``), not ``pathlib``: on
CPython 3.11 ``pathlib`` interns every part of a path it parses (``sys.intern``), and a model's
file name interned for one request and freed after it leaves a dead entry in the interpreter's
table of interned strings. One per request doubled that table (0.94 MB to 1.88 MB, for good)
after ~6,000 requests of a soak (``tests/api/test_interned.py``).
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
from trioshed.models.projectors import (
    FolderPairing,
    first_architecture,
    is_projector_name,
    pair_folder,
)
from trioshed.models.resolved import settled

log = logging.getLogger(__name__)


@dataclass
class _DigestCacheEntry:
    key: tuple[int, int]
    digest: str


class ModelStore:
    """Resolves model names to :class:`ModelSpec` and lists what the folder holds."""

    def __init__(self, root: Path, *, allow_symlinks: bool = False) -> None:
        self.root = Path(root)
        self._root = str(self.root)  # lookups work on strings (the module docstring says why)
        self._toml = os.path.join(self._root, "models.toml")
        self.allow_symlinks = allow_symlinks
        self._digests: dict[str, _DigestCacheEntry] = {}
        self._catalogue: tuple[tuple[int, int, int] | None, Catalogue] | None = None
        #: folder -> (its identity when scanned, its pairing); file identity -> architecture
        self._pairings: dict[str, tuple[tuple[int, int], FolderPairing]] = {}
        self._architectures: dict[tuple[str, int, int], str | None] = {}

    def _inside(self, file: str | Path) -> bool:
        """Whether ``file`` (in the store folder) really lies in it: a symlink pointing out of the
        store is followed only with TRIOSHED_ALLOW_SYMLINKS (models.toml can name any path)."""
        if self.allow_symlinks:
            return True
        file = os.fspath(file)
        if os.path.dirname(file) == self._root and not os.path.islink(file):
            return True  # a file right in the folder, not a link: where the folder is (one lstat)
        try:
            real, root = os.path.realpath(file), os.path.realpath(self._root)
        except (OSError, ValueError):
            return False
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    @property
    def toml_path(self) -> Path:
        return Path(self._toml)

    def _toml_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._toml)
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
        self, full_name: str, path: str, stat: os.stat_result | None = None, **extra: object
    ) -> ModelSpec:
        stat = stat or os.stat(path)
        return ModelSpec(
            name=full_name, path=path, size=stat.st_size, modified=stat.st_mtime, **extra  # type: ignore[arg-type]
        )

    def _spec_from_entry(self, entry: Entry, name: str) -> ModelSpec:
        for what, path in (("path", entry.path), *(("adapter", a) for a in entry.adapters),
                           *((("projector", entry.projector),) if entry.projector else ())):  # fmt: skip
            if not os.path.isfile(path):
                raise BadRequest(f"models.toml: {what} {path!r} of model '{name}' does not exist")
        projector, problem = (entry.projector, "") if entry.projector else self.projector_of(entry.path)
        return self._spec_from_file(
            name,
            entry.path,
            adapters=entry.adapters,
            adapter_scales=entry.adapter_scales,
            projector=projector,
            projector_problem=problem,
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

    def is_plain(self, spec: ModelSpec) -> bool:
        """Whether ``spec`` is a plain model file of this folder (``NAME.gguf`` as ``NAME:latest``,
        not a ``models.toml`` entry nor a sub-folder's model): what its spec follows is the file,
        the folder and ``models.toml`` (:mod:`trioshed.models.resolved`)."""
        folder, file = os.path.split(spec.path)
        return (
            folder == self._root and file.endswith(".gguf") and spec.name == f"{file[:-5]}:latest"
            and self.catalogue().lookup(spec.name) is None
        )  # fmt: skip

    def resolve(self, name: str) -> ModelSpec:
        base, tag = split_name(name)
        full = f"{base}:{tag}"
        entry = self.catalogue().lookup(full)
        if entry is not None:
            return self._spec_from_entry(entry, full)
        if tag != "latest":
            raise ModelNotFound(name)
        file = os.path.join(self._root, f"{base}.gguf")
        try:
            found = os.stat(file)
        except (OSError, ValueError):
            return self._resolve_subfolder(name, base)
        if not stat_module.S_ISREG(found.st_mode):
            raise ModelNotFound(name)
        if not self._inside(file):
            raise Forbidden(
                f"model '{name}' is a symlink to a file outside the model store; name that file in "
                "models.toml, or set TRIOSHED_ALLOW_SYMLINKS=1 to follow such links"
            )
        if self._is_projector(f"{base}.gguf", found, file):
            raise ModelNotFound(name)  # a projector goes with its model, it is not one
        projector, problem = self.projector_of(file)
        return self._spec_from_file(full, file, found, projector=projector, projector_problem=problem)

    def _resolve_subfolder(self, name: str, base: str) -> ModelSpec:
        """``base/`` holding one model (and maybe its projector): llama.cpp's router layout."""
        folder = os.path.join(self._root, base)
        if base.startswith(".") or not os.path.isdir(folder) or not self._inside(folder):
            raise ModelNotFound(name)
        models = [n for n in self._names(folder) if n not in self._pairing(folder).projectors]
        if len(models) != 1:
            raise ModelNotFound(name)
        file = os.path.join(folder, models[0])
        if not self._inside(file):
            raise ModelNotFound(name)
        projector, problem = self.projector_of(file)
        return self._spec_from_file(f"{base}:latest", file, projector=projector, projector_problem=problem)

    # -- projectors --------------------------------------------------------------------------

    def projector_of(self, model: str | Path) -> tuple[str | None, str]:
        """The projector that goes with the model file ``model`` on its own (its folder's
        pairing), or None and why not when the folder leaves it ambiguous ("" when it holds
        none for it). Only folders of this store are paired."""
        folder, name = os.path.split(os.fspath(model))
        if folder != self._root and os.path.dirname(folder) != self._root:
            return None, ""
        pairing = self._pairing(folder)
        paired = pairing.paired.get(name)
        return (os.path.join(folder, paired), "") if paired else (None, pairing.ambiguous.get(name, ""))

    def _names(self, folder: str) -> list[str]:
        try:
            with os.scandir(folder) as found:
                return sorted(e.name for e in found if e.name.endswith(".gguf") and not e.name.startswith("."))
        except OSError:
            return []

    def _is_projector(self, file_name: str, st: os.stat_result, path: str) -> bool:
        """Whether a GGUF file is a projector: by its name, else by its first header key (read
        once per file version)."""
        if is_projector_name(file_name):
            return True
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self._architectures:
            if len(self._architectures) > 8192:
                self._architectures.clear()
            self._architectures[key] = first_architecture(path)
        return self._architectures[key] == "clip"

    def _pairing(self, folder: str) -> FolderPairing:
        """``folder``'s pairing, scanned again when the folder changed (its mtime); an
        ambiguous pairing is logged each time it is scanned."""
        try:
            st = os.stat(folder)
        except OSError:
            return FolderPairing()
        identity = (st.st_mtime_ns, st.st_ino)
        cached = self._pairings.get(folder)
        if cached is not None and cached[0] == identity:
            return cached[1]
        names = self._names(folder)
        by_header = set()
        for n in names:
            try:
                path = os.path.join(folder, n)
                if not is_projector_name(n) and self._is_projector(n, os.stat(path), path):
                    by_header.add(n)
            except OSError:
                continue
        pairing = pair_folder(names, projectors=by_header)
        for model, why in sorted(pairing.ambiguous.items()):
            log.warning("no projector for %s: %s; name it in models.toml (projector = \"...\")", os.path.join(folder, model), why)
        if settled(st.st_mtime_ns):  # a change in the same clock tick would leave this stamp
            self._pairings[folder] = (identity, pairing)
        return pairing

    def links_out(self) -> list[Path]:
        """``*.gguf`` symlinks pointing out of the store: not served unless TRIOSHED_ALLOW_SYMLINKS."""
        if not self.root.is_dir():
            return []
        return [p for p in sorted(self.root.glob("*.gguf")) if p.is_symlink() and not self._inside(p)]

    def list(self) -> list[ModelSpec]:
        specs: dict[str, ModelSpec] = {}
        try:
            with os.scandir(self.root) as found:
                entries = sorted((e for e in found if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError:  # no folder (yet), or not one
            entries = []
        pairing = self._pairing(self._root) if entries else FolderPairing()
        folders: list[str] = []
        # One stat per file: a store of thousands lists in milliseconds (the glob, the
        # is_file and two resolves per file were ~17 system calls each).
        for found_file in entries:
            if not found_file.name.endswith(".gguf"):
                if is_name_part(found_file.name) and found_file.is_dir(follow_symlinks=False):
                    folders.append(found_file.name)
                continue
            stem = found_file.name[: -len(".gguf")]
            if not is_name_part(stem) or found_file.name in pairing.projectors:
                continue
            try:
                st = found_file.stat()  # follows a symlink
            except OSError:
                continue  # a dangling link, or gone since
            if not stat_module.S_ISREG(st.st_mode) or (found_file.is_symlink() and not self._inside(found_file.path)):
                continue
            name = f"{stem}:latest"
            paired = pairing.paired.get(found_file.name)
            specs[name] = ModelSpec(name=name, path=found_file.path, size=st.st_size, modified=st.st_mtime,
                                    projector=os.path.join(self._root, paired) if paired else None,
                                    projector_problem=pairing.ambiguous.get(found_file.name, ""))  # fmt: skip
        for folder in folders:
            if f"{folder}:latest" not in specs:
                try:
                    specs[f"{folder}:latest"] = self._resolve_subfolder(folder, folder)
                except (ModelNotFound, OSError):
                    continue  # not a model's folder
        for name, entry in self.catalogue().names.items():  # entries and their aliases
            try:
                specs[name] = self._spec_from_entry(entry, name)
            except BadRequest:
                continue  # its file is missing: reported when models.toml was read
        return sorted(specs.values(), key=lambda s: s.name)

    def digest(self, spec: ModelSpec) -> str:
        """sha256 of the GGUF file, cached by (size, mtime). Blocking: call in a thread."""
        stat = os.stat(spec.path)
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
