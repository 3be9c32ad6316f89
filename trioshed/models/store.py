"""The model store: a folder of ``*.gguf`` files, optionally described further by ``models.toml``.

Each ``NAME.gguf`` is model ``NAME:latest`` (``NAME`` resolves too). ``models.toml`` may add
entries with adapters, a projector and default options::

    [models."mistral-lora"]
    path = "mistral-7b.gguf"          # relative to the store folder
    adapters = ["my-lora.gguf"]
    projector = "mmproj.gguf"
    options = { num_ctx = 8192, temperature = 0.2 }

The folder is re-read on each lookup (a stat per file: cheap), so models copied in while
trioshed runs appear at once.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, ModelNotFound

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def split_name(name: str) -> tuple[str, str]:
    """``"gemma3-270m:latest"`` → ``("gemma3-270m", "latest")``; names that could escape → 400."""
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("model is required")
    base, _, tag = name.strip().partition(":")
    tag = tag or "latest"
    if "/" in base or "\\" in base or ".." in base or not _NAME.match(base) or not _TAG.match(tag):
        raise BadRequest(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' with an optional ':tag'"
        )
    return base, tag


@dataclass
class _DigestCacheEntry:
    key: tuple[int, int]
    digest: str


class ModelStore:
    """Resolves model names to :class:`ModelSpec` and lists what the folder holds."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._digests: dict[str, _DigestCacheEntry] = {}

    def _toml_entries(self) -> dict[str, dict[str, object]]:
        path = self.root / "models.toml"
        if not path.is_file():
            return {}
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise BadRequest(f"cannot read {path}: {exc}") from None
        models = data.get("models", {})
        return models if isinstance(models, dict) else {}

    def _spec_from_file(self, full_name: str, path: Path, **extra: object) -> ModelSpec:
        stat = path.stat()
        return ModelSpec(
            name=full_name, path=str(path), size=stat.st_size, modified=stat.st_mtime, **extra  # type: ignore[arg-type]
        )

    def _resolve_file(self, value: object, what: str, model: str) -> str:
        if not isinstance(value, str):
            raise BadRequest(f"models.toml: {what} of model '{model}' must be a path")
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = self.root / path
        if not path.is_file():
            raise BadRequest(f"models.toml: {what} {str(path)!r} of model '{model}' does not exist")
        return str(path)

    def resolve(self, name: str) -> ModelSpec:
        base, tag = split_name(name)
        full = f"{base}:{tag}"
        entries = self._toml_entries()
        entry = entries.get(base) or entries.get(full)
        if isinstance(entry, dict):
            path = self._resolve_file(entry.get("path"), "path", full)
            adapters = tuple(self._resolve_file(a, "adapter", full) for a in entry.get("adapters", []))  # type: ignore[attr-defined]
            projector = entry.get("projector")
            options = entry.get("options", {})
            return self._spec_from_file(
                full,
                Path(path),
                adapters=adapters,
                projector=self._resolve_file(projector, "projector", full) if projector else None,
                defaults=tuple(sorted(options.items())) if isinstance(options, dict) else (),
            )
        if tag != "latest":
            raise ModelNotFound(name)
        file = self.root / f"{base}.gguf"
        if not file.is_file():
            raise ModelNotFound(name)
        return self._spec_from_file(full, file)

    def list(self) -> list[ModelSpec]:
        specs: dict[str, ModelSpec] = {}
        if self.root.is_dir():
            for path in sorted(self.root.glob("*.gguf")):
                if path.is_file() and _NAME.match(path.stem):
                    specs[f"{path.stem}:latest"] = self._spec_from_file(f"{path.stem}:latest", path)
        for name in self._toml_entries():
            try:
                spec = self.resolve(name)
            except (BadRequest, ModelNotFound):
                continue
            specs[spec.name] = spec
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
