"""``TRIOSHED_MODELS``: one or more store folders, separated by ``:``, searched in order.

Each folder is either trioshed's own folder store (``*.gguf`` and ``models.toml``,
:class:`~trioshed.models.store.ModelStore`) or an existing Ollama store (``manifests/`` and
``blobs/``, :class:`~trioshed.models.ollama_store.OllamaStore`, read-only). A name resolves in the
first folder that has it; listings merge all folders (the first folder wins a name).

``/api/copy`` adds a ``[models."dest"]`` entry to the first folder store's ``models.toml`` (its
``path`` names the source's file, wherever that lives); ``/api/delete`` removes a name from the
folder store that has it (a GGUF file, a ``models.toml`` entry or alias). Only whole
``[models.…]`` tables are rewritten, and only when the re-parsed file is exactly the intended
change. An Ollama store is never written.
Blocking (files): call from a worker thread.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Any

from trioshed.core.adapters import scales_of
from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, Conflict, Forbidden, ModelNotFound
from trioshed.models.blobs import write_manifest
from trioshed.models.catalogue import Catalogue, parse_catalogue
from trioshed.models.groups import Groups, store_changed
from trioshed.models.names import full_name, split_name
from trioshed.models.ollama_store import OllamaManifest, OllamaStore, is_ollama_store, parse_name
from trioshed.models.pull_plan import PULLED, manifest_path_parts
from trioshed.models.resolved import Resolved
from trioshed.models.store import ModelStore

Backend = ModelStore | OllamaStore


def store_folders(models: Path | str) -> list[Path]:
    """The folders of a ``TRIOSHED_MODELS`` value: ``:``-separated, unless it names one folder."""
    text = str(models)
    if Path(text).expanduser().is_dir() or os.pathsep not in text:
        return [Path(text).expanduser()]
    return [Path(part).expanduser() for part in text.split(os.pathsep) if part]


class Stores:
    """Name resolution over every folder of ``TRIOSHED_MODELS``, and the changes the API makes."""

    def __init__(self, models: Path | str, *, allow_symlinks: bool = False) -> None:
        self.folders = store_folders(models)
        self._folder_stores = {folder: ModelStore(folder, allow_symlinks=allow_symlinks) for folder in self.folders}
        self._pulled = {folder: folder / PULLED for folder in self.folders}
        self._lock = threading.Lock()  # copy/delete edit models.toml: one at a time
        stamped = [p for f in self.folders for p in (str(f), str(self._pulled[f]), str(self._folder_stores[f].toml_path))]
        self._resolved = Resolved(stamped)
        self._groups = Groups(self._adapter_models, stamped)

    def backends(self) -> list[Backend]:
        """A store per folder; a folder is an Ollama store when it has manifests/ and blobs/
        (checked on each call: two stats). A folder store's ``pulled/`` (what ``/api/pull``
        writes, in Ollama's layout) follows it."""
        found: list[Backend] = []
        for folder in self.folders:
            if is_ollama_store(folder):
                found.append(OllamaStore(folder))
                continue
            found.append(self._folder_stores[folder])
            if is_ollama_store(pulled := self._pulled[folder]):
                found.append(OllamaStore(pulled))
        return found

    @property
    def pull_root(self) -> Path | None:
        """Where ``/api/pull`` writes: the first folder store's ``pulled/`` (None when every
        folder is a read-only Ollama store)."""
        store = self.writable
        return None if store is None else store.root / PULLED

    def _is_pulled(self, backend: Backend) -> bool:
        """Whether ``backend`` is a folder store's ``pulled/`` (trioshed's own, so deletable)."""
        return (
            isinstance(backend, OllamaStore)
            and backend.root.name == PULLED
            and backend.root.parent in self._folder_stores
            and not is_ollama_store(backend.root.parent)
        )

    @property
    def writable(self) -> ModelStore | None:
        """The folder store that copies and deletes change: the first one."""
        return next((b for b in self.backends() if isinstance(b, ModelStore)), None)

    def resolve(self, name: str) -> ModelSpec:
        """The spec ``name`` names: kept from an earlier lookup while nothing it follows has
        changed (:mod:`trioshed.models.resolved`), else looked up in the folders."""
        if isinstance(name, str) and (spec := self._resolved.get(name)) is not None:
            return self._groups.attach(spec)
        backend, spec = self._find(name)
        if isinstance(backend, ModelStore) and backend.is_plain(spec) and all(isinstance(b, ModelStore) for b in self.backends()):
            self._resolved.keep(name, spec)
        return self._groups.attach(spec)

    def _adapter_models(self) -> tuple[list[ModelSpec], bool]:
        """Every model with adapters (``models.toml`` entries and Ollama manifests), and whether
        an Ollama store is among the folders (:class:`~trioshed.models.groups.Groups`)."""
        specs: list[ModelSpec] = []
        volatile = False
        for backend in self.backends():
            if isinstance(backend, OllamaStore):
                volatile = True
                specs += [s for s in backend.list() if s.adapters]
                continue
            for entry in backend.catalogue().entries:
                if entry.adapters:
                    try:
                        specs.append(backend.resolve(entry.name))
                    except (BadRequest, ModelNotFound, OSError):
                        continue  # a file missing: reported when models.toml was read
        return specs, volatile

    def catalogue(self) -> Catalogue:
        """The ``models.toml`` entries of every folder store, in folder order (the first folder
        wins a name), and all their problems."""
        return _merged([b.catalogue() for b in self.backends() if isinstance(b, ModelStore)])

    def links_out(self) -> list[Path]:
        """Every folder store's ``*.gguf`` symlinks pointing out of it (not served by default)."""
        return [p for b in self.backends() if isinstance(b, ModelStore) for p in b.links_out()]

    def reload(self) -> Catalogue:
        """Re-read every folder store's ``models.toml`` now (logging its problems)."""
        return _merged([b.reload() for b in self.backends() if isinstance(b, ModelStore)])

    def _find(self, name: str) -> tuple[Backend, ModelSpec]:
        if not isinstance(name, str) or not name.strip():
            raise BadRequest("model is required")
        asked = False
        for backend in self.backends():
            if isinstance(backend, ModelStore) and "/" in name:
                continue  # "user/model": only an Ollama store holds such names
            asked = True
            try:
                return backend, backend.resolve(name)
            except ModelNotFound:
                continue  # a bad name or a broken model (BadRequest) is said at once
        if not asked:
            split_name(name)  # raises the folder store's 400 for the name
        raise ModelNotFound(name)

    def list(self) -> list[ModelSpec]:
        specs: dict[str, ModelSpec] = {}
        for backend in self.backends():
            for spec in backend.list():
                specs.setdefault(spec.name, spec)
        return sorted(specs.values(), key=lambda s: s.name)

    def digest(self, spec: ModelSpec) -> str:
        if isinstance(spec.origin, OllamaManifest):
            return spec.origin.digest
        return self._folder_stores[self.folders[0]].digest(spec) if self.folders else ""

    def cached_digest(self, spec: ModelSpec) -> str | None:
        if isinstance(spec.origin, OllamaManifest):
            return spec.origin.digest
        return self._folder_stores[self.folders[0]].cached_digest(spec) if self.folders else None

    # -- changes ------------------------------------------------------------------------------

    def find_for_delete(self, name: str) -> ModelSpec:
        """The model ``name`` if trioshed may delete it: 403 in a read-only store, 404 unknown,
        409 for a GGUF file that ``models.toml`` entries still use."""
        backend, spec = self._find(name)
        if self._is_pulled(backend):
            return spec
        if isinstance(backend, OllamaStore):
            raise Forbidden(
                f"model '{spec.name}' is in the Ollama store {backend.root}, which trioshed only reads; "
                "remove it with 'ollama rm' instead"
            )
        if backend.catalogue().lookup(spec.name) is None:
            users = sorted(e.name for e in backend.catalogue().entries if _same_file(e.path, spec.path))
            if users:
                raise Conflict(
                    f"model '{spec.name}' is the file of models.toml entries {', '.join(users)}; "
                    f"delete those first (or edit {backend.toml_path})"
                )
        return spec

    def shares_file(self, spec: ModelSpec) -> bool:
        """Whether another name of the store serves ``spec``'s GGUF file (then deleting
        ``spec.name`` leaves its runner loaded for the others)."""
        return any(s.path == spec.path and s.name != spec.name for s in self.list())

    def delete(self, name: str, *, protect: frozenset[str] = frozenset()) -> ModelSpec:
        """Remove the name ``name``, as Ollama removes one name and leaves the others: an alias
        leaves its entry's ``aliases``; an entry's own name goes with its table (its first alias,
        if any, takes the table over); a plain ``NAME.gguf`` is removed. The blobs in ``protect``
        (claimed by a pull or push in progress: :class:`~trioshed.models.writer.StoreWriter`)
        are never removed."""
        with self._lock:
            spec = self.find_for_delete(name)
            backend, _ = self._find(name)
            if isinstance(backend, OllamaStore):  # a pulled model (find_for_delete allowed it)
                assert isinstance(spec.origin, OllamaManifest)
                entries = self.catalogue().entries  # a models.toml entry may name a pulled blob (/api/copy)
                keep = {Path(p).name for e in entries for p in (e.path, *e.adapters, e.projector or "") if p}
                remove_pulled(backend.root, Path(spec.origin.path), keep=keep | protect)
                return spec
            entry = backend.catalogue().lookup(spec.name)
            if entry is None:
                Path(spec.path).unlink()
                return spec
            key, table = _raw_table(backend, entry.name)
            aliases = [a for a in table.get("aliases", []) if full_name(a) != spec.name]
            rest = {k: v for k, v in table.items() if k != "aliases"} | ({"aliases": aliases[1:] if spec.name == entry.name else aliases} if aliases else {})
            if spec.name != entry.name:  # an alias: the entry stays, without it
                _rewrite_toml(backend.toml_path, remove=key, add=(key, rest))
            elif aliases:  # the entry's own name: its first alias takes the table over
                if not rest.get("aliases"):
                    rest.pop("aliases", None)
                _rewrite_toml(backend.toml_path, remove=key, add=(aliases[0], rest))
            else:
                _rewrite_toml(backend.toml_path, remove=key)
            return spec

    def copy(self, source: str, destination: str) -> str:
        """Add ``destination`` as a ``models.toml`` entry naming ``source``'s files and settings
        (path, adapters, projector, options, system prompt, num_parallel, priority, args,
        speculation, draft;
        not pinned, preload or keep_alive). Returns the destination's full name."""
        dest = full_name(destination)
        base, tag = split_name(dest)
        key = base if tag == "latest" else dest
        with self._lock:
            backend, spec = self._find(source)
            if self._is_pulled(backend) and isinstance(spec.origin, OllamaManifest):
                return self._copy_manifest(backend.root, spec.origin, destination)
            if spec.name == dest:
                return dest  # a copy onto itself changes nothing
            store = self.writable
            if store is None:
                raise Forbidden(
                    "copy needs a folder store to write models.toml into; every folder in "
                    "TRIOSHED_MODELS is a read-only Ollama store"
                )
            existing = store.catalogue().lookup(dest)
            if existing is not None and existing.name != dest:
                raise Conflict(f"'{dest}' is an alias of models.toml entry '{existing.name}'; delete it first")
            if existing is None and tag == "latest" and (store.root / f"{base}.gguf").exists():
                raise Conflict(f"'{dest}' is the GGUF file {store.root / f'{base}.gguf'}; delete it first or copy to another name")
            entry: dict[str, object] = {"path": _relative(store.root, spec.path)}
            if spec.adapters:
                scales = scales_of(spec)
                entry["adapters"] = [
                    _relative(store.root, a) if scale == 1.0 else {"path": _relative(store.root, a), "scale": scale}
                    for a, scale in zip(spec.adapters, scales, strict=True)
                ]
            if spec.projector:
                entry["projector"] = _relative(store.root, spec.projector)
            if spec.defaults:
                entry["options"] = dict(spec.defaults)
            if spec.system:
                entry["system"] = spec.system
            if spec.num_parallel is not None:
                entry["num_parallel"] = spec.num_parallel
            if spec.priority:
                entry["priority"] = spec.priority
            if spec.args:
                entry["args"] = list(spec.args)
            if spec.speculation is not None:
                entry["speculation"] = spec.speculation
            if spec.draft is not None:
                entry["draft"] = spec.draft
            store.root.mkdir(parents=True, exist_ok=True)
            remove = _raw_table(store, existing.name)[0] if existing is not None else key
            _rewrite_toml(store.toml_path, remove=remove, add=(key, entry), must_serve=dest)
            return dest


    def _copy_manifest(self, root: Path, origin: OllamaManifest, destination: str) -> str:
        """A pulled or created model copied as Ollama copies it: its manifest under the new name
        (the blobs are shared; deleting either name keeps what the other still names)."""
        name = parse_name(destination)
        parts = manifest_path_parts(name)
        if name.key == origin.name.key:
            return name.display()
        for backend in self.backends():
            if isinstance(backend, ModelStore) and "/" not in destination:
                if backend.catalogue().lookup(full_name(destination)) is not None or (backend.root / f"{split_name(full_name(destination))[0]}.gguf").exists():
                    raise Conflict(f"'{destination}' is a model of the folder store {backend.root}; delete it first or copy to another name")
        data = Path(origin.path).read_bytes()
        top = root / "manifests"
        for path in top.glob("*/*/*/*"):  # the same name in another letter case is replaced
            if parse_name("/".join(path.relative_to(top).parts[:3]) + ":" + path.name).key == name.key and path.relative_to(top).parts != parts:
                path.unlink()
        write_manifest(root, parts, data)
        return name.display()


def remove_pulled(root: Path, manifest: Path, *, keep: frozenset[str] | set[str] = frozenset()) -> None:
    """Remove a pulled or created model's manifest, then those of its blobs no other manifest
    names (as ``ollama rm`` prunes layers) and not in ``keep`` (blob file names a
    ``models.toml`` entry uses); uploads no manifest names yet and partial files are left alone."""
    layers = manifest_blobs(manifest)
    manifest.unlink()
    store_changed()
    for parent in list(manifest.parents)[: len(manifest.relative_to(root / "manifests").parts) - 1]:
        try:
            parent.rmdir()  # empty tag folders of the name go too
        except OSError:
            break
    prune_blobs(root, layers, keep=keep)


def manifest_blobs(manifest: Path) -> set[str]:
    """The blob file names (``sha256-<hex>``) a manifest names, its config included."""
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return set()
    layers = [*(data.get("layers") or []), data.get("config") or {}] if isinstance(data, dict) else []
    return {str(layer.get("digest", "")).replace(":", "-") for layer in layers if isinstance(layer, dict)}


def prune_blobs(root: Path, candidates: set[str], *, keep: frozenset[str] | set[str] = frozenset()) -> None:
    """Remove the blobs among ``candidates`` (file names) that no manifest of ``root`` names and
    that are not in ``keep``."""
    used: set[str] = set()
    for path in (root / "manifests").glob("*/*/*/*"):
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return  # a manifest trioshed cannot read: keep every blob
        layers = [*(data.get("layers") or []), data.get("config") or {}] if isinstance(data, dict) else []
        used.update(str(layer.get("digest", "")).replace(":", "-") for layer in layers if isinstance(layer, dict))
    for name in candidates - used - set(keep):
        if name.startswith("sha256-") and "/" not in name and not name.endswith("-partial"):
            (root / "blobs" / name).unlink(missing_ok=True)


def _merged(catalogues: list[Catalogue]) -> Catalogue:
    if len(catalogues) == 1:
        return catalogues[0]
    return Catalogue(
        tuple(e for c in catalogues for e in c.entries), tuple(p for c in catalogues for p in c.problems)
    )


def _raw_table(store: ModelStore, name: str) -> tuple[str, dict[str, Any]]:
    """The key and the table, as written, of the ``models.toml`` entry called ``name``."""
    models = tomllib.loads(store.toml_path.read_text()).get("models", {})
    for key, table in models.items():
        if isinstance(table, dict) and full_name(key) == name:
            return key, table
    raise Conflict(f"cannot find the entry '{name}' in {store.toml_path}; edit it by hand")


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _relative(root: Path, path: str) -> str:
    p = Path(path)
    return p.name if p.parent == root else str(p)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRequest(f"cannot write {value!r} to models.toml")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise BadRequest(f"cannot write {value!r} to models.toml")


def _rewrite_toml(
    path: Path, *, remove: str, add: tuple[str, dict[str, object]] | None = None, must_serve: str | None = None
) -> None:
    """Remove the ``[models."<remove>"]`` table (if present) and append ``add``'s table.

    Only whole ``[models.…]`` tables are removed (the lines from their header to the next
    header); the result is parsed again and must equal the old document with exactly that
    change, else nothing is written (409); with ``must_serve``, the new catalogue must serve
    that name (no alias clash, no invalid key). The file is replaced atomically.
    """
    old_text = path.read_text() if path.is_file() else ""
    try:
        old = tomllib.loads(old_text)
    except tomllib.TOMLDecodeError as exc:
        raise Conflict(f"cannot edit {path}: it is not valid TOML ({exc})") from None
    lines = old_text.splitlines(keepends=True)
    out: list[str] = []
    skipping = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = _is_header_of(stripped, remove)
        if not skipping:
            out.append(line)
    text = "".join(out)
    if add is not None:
        key, entry = add
        if text and not text.endswith("\n"):
            text += "\n"
        text += f"\n[models.{json.dumps(key)}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in entry.items())
    expected = dict(old)
    models = dict(expected.get("models") or {})
    models.pop(remove, None)
    if add is not None:
        models[add[0]] = add[1]
    expected["models"] = models
    try:
        new = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Conflict(f"cannot edit {path} safely ({exc}); edit it by hand") from None
    new.setdefault("models", {})
    if _normal(new) != _normal(expected):
        raise Conflict(f"cannot edit the entry '{remove}' of {path} safely; edit it by hand")
    if must_serve is not None:
        catalogue = parse_catalogue(text, str(path), path.parent)
        if catalogue.lookup(must_serve) is None:
            reasons = "; ".join(p.reason for p in catalogue.problems) or "unknown"
            raise Conflict(f"'{must_serve}' would not be served from {path}: {reasons}")
    fd, tmp = tempfile.mkstemp(prefix=".models.toml.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _normal(value: object) -> object:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _is_header_of(header: str, key: str) -> bool:
    """Whether ``header`` (a stripped ``[...]`` line) opens ``[models.<key>]`` or a sub-table."""
    if header.startswith("[["):
        return False
    try:
        parsed = tomllib.loads(header + "\n")
    except tomllib.TOMLDecodeError:
        return False
    models = parsed.get("models")
    return isinstance(models, dict) and key in models
