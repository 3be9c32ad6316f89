"""An existing Ollama model store (``~/.ollama/models``), read-only.

Layout (what ``ollama pull`` writes)::

    manifests/<registry>/<namespace>/<model>/<tag>     JSON, schemaVersion 2
    blobs/sha256-<hex>                                  content-addressed layers

A manifest's ``layers`` carry a ``mediaType``, a ``digest`` (``sha256:<hex>``) and a ``size``:

* ``application/vnd.ollama.image.model``: the GGUF weights (the file llama-server loads);
* ``…image.projector``: a multimodal projector (``--mmproj``); ``…image.adapter``: a LoRA;
* ``…image.params``: default options (JSON); ``…image.template`` / ``…image.system`` /
  ``…image.license``: text.

Its ``config`` blob (``application/vnd.docker.container.image.v1+json``) holds the details Ollama
lists (``model_family``, ``model_type`` as the parameter size, ``file_type`` as the quantization).

Names are shown as Ollama shows them (``DisplayShortest``): ``llama3.2:1b`` for
``registry.ollama.ai/library/llama3.2:1b``, ``user/model:tag`` for another namespace on the
default registry, ``host/ns/model:tag`` for another registry. A name typed with ``library/`` or
``registry.ollama.ai/`` resolves to the same model, and so does any letter case.

trioshed never writes here: it only reads manifests and hands blob paths to llama-server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trioshed.core.model import ModelSpec
from trioshed.errors import BadRequest, ModelNotFound

log = logging.getLogger(__name__)

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_LICENSE = "application/vnd.ollama.image.license"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"

_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(:[0-9]+)?$")

#: Loaded manifests by (path, mtime_ns, size): a request for an Ollama-store model costs a stat.
_LOADED: dict[tuple[str, int, int], ModelSpec] = {}


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Ollama compares names without regard to case."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    def display(self) -> str:
        """Ollama's ``DisplayShortest``: the registry and namespace only where not the defaults."""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        else:
            prefix = ""
        return f"{prefix}{self.model}:{self.tag}"


def parse_name(name: str) -> OllamaName:
    """``[host/][namespace/]model[:tag]`` with Ollama's defaults; an unsafe part → BadRequest.

    A ``:`` followed by a ``/`` is a port (``localhost:5000/ns/m``), not a tag.
    """
    text = name.strip() if isinstance(name, str) else ""
    if not text:
        raise BadRequest("model is required")
    text = text.partition("@")[0]  # "@sha256:..." pins a digest; the tag's manifest is the one
    base, sep, tag = text.rpartition(":")
    if not sep or "/" in tag:
        base, tag = text, ""
    parts = base.split("/")
    if len(parts) > 3 or not all(parts):
        raise BadRequest(f"invalid model name {name!r}: use [host/][namespace/]model[:tag]")
    model = parts[-1]
    namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    host = parts[-3] if len(parts) == 3 else DEFAULT_HOST
    tag = tag or DEFAULT_TAG
    if not (_PART.match(model) and _PART.match(namespace) and _PART.match(tag) and _HOST.match(host)) or ".." in text:
        raise BadRequest(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    return OllamaName(host, namespace, model, tag)


def _names_in(folder: str) -> list[str]:
    """The names in ``folder`` not starting with a dot, sorted ([] when it is not a folder)."""
    try:
        with os.scandir(folder) as entries:
            return sorted(e.name for e in entries if not e.name.startswith("."))
    except OSError:
        return []


def is_ollama_store(path: str | Path) -> bool:
    """Whether ``path`` looks like an Ollama models folder (``manifests/`` and ``blobs/``); two
    stats, on strings (asked on every lookup)."""
    return os.path.isdir(os.path.join(path, "manifests")) and os.path.isdir(os.path.join(path, "blobs"))


@dataclass(frozen=True)
class OllamaManifest:
    """What a manifest says about one model, beyond the files a runner needs (``ModelSpec``)."""

    name: OllamaName
    path: str  # the manifest file
    digest: str  # sha256 of the manifest file, as /api/tags shows it
    size: int  # the sum of the layers and the config, as /api/tags shows it
    template: str = ""
    system: str = ""
    license: str = ""
    family: str = ""
    families: tuple[str, ...] = ()
    parameter_size: str = ""
    quantization_level: str = ""
    licenses: tuple[str, ...] = ()  # each license layer
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of the messages layer
    requires: str = ""  # the config's "requires" (a Modelfile's REQUIRES)


class OllamaStore:
    """Resolves names to :class:`ModelSpec` from an Ollama store's manifests; never writes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"OllamaStore({str(self.root)!r})"

    def _index(self) -> dict[tuple[str, str, str, str], tuple[OllamaName, str]]:
        """Every manifest file, by its name's case-folded key (a walk of four levels: cheap; on
        strings, as :meth:`resolve`)."""
        found: dict[tuple[str, str, str, str], tuple[OllamaName, str]] = {}
        top = os.path.join(self.root, "manifests")
        for host in _names_in(top):
            for namespace in _names_in(os.path.join(top, host)):
                for model in _names_in(os.path.join(top, host, namespace)):
                    for tag in _names_in(os.path.join(top, host, namespace, model)):
                        path = os.path.join(top, host, namespace, model, tag)
                        if os.path.isfile(path):
                            name = OllamaName(host, namespace, model, tag)
                            found.setdefault(name.key, (name, path))
        return found

    def blob(self, digest: object) -> Path:
        match = _DIGEST.match(digest) if isinstance(digest, str) else None
        if not match:
            raise BadRequest(f"Ollama store {self.root}: invalid layer digest {digest!r}")
        return self.root / "blobs" / f"sha256-{match.group(1)}"

    def _text(self, layer: dict[str, Any]) -> str:
        try:
            return self.blob(layer.get("digest")).read_text(errors="replace")
        except OSError:
            return ""

    def _load(self, name: OllamaName, path: Path) -> ModelSpec:
        raw = path.read_bytes()
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"Ollama manifest {path} is not valid JSON: {exc}") from None
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        if not isinstance(layers, list):
            raise BadRequest(f"Ollama manifest {path} has no layers")
        layers = [layer for layer in layers if isinstance(layer, dict)]
        by_type: dict[str, list[dict[str, Any]]] = {}
        for layer in layers:
            by_type.setdefault(str(layer.get("mediaType")), []).append(layer)
        models = by_type.get(MEDIA_MODEL)
        if not models:
            raise BadRequest(f"Ollama manifest {path} has no model layer ({MEDIA_MODEL})")
        weights = self.blob(models[0].get("digest"))
        if not weights.is_file():
            raise BadRequest(f"Ollama store {self.root}: blob {weights.name} of '{name.display()}' is missing")
        adapters = tuple(str(self.blob(a.get("digest"))) for a in by_type.get(MEDIA_ADAPTER, []))
        projectors = [str(self.blob(p.get("digest"))) for p in by_type.get(MEDIA_PROJECTOR, [])]
        defaults: dict[str, object] = {}
        for layer in by_type.get(MEDIA_PARAMS, []):
            try:
                params = json.loads(self._text(layer) or "{}")
            except ValueError:
                log.warning("Ollama store %s: params layer of %s is not JSON (ignored)", self.root, name.display())
                continue
            if isinstance(params, dict):
                defaults.update(params)
        config = self._config(manifest)
        families = config.get("model_families")
        size = sum(int(layer.get("size") or 0) for layer in layers)
        if isinstance(manifest.get("config"), dict):
            size += int(manifest["config"].get("size") or 0)
        stat = path.stat()
        licenses = tuple(self._text(t) for t in by_type.get(MEDIA_LICENSE, []))
        messages: list[tuple[str, str]] = []
        for layer in by_type.get(MEDIA_MESSAGES, [])[-1:]:
            try:
                loaded = json.loads(self._text(layer) or "[]")
            except ValueError:
                loaded = []
            messages += [(str(m.get("role")), str(m.get("content") or "")) for m in loaded if isinstance(m, dict)] if isinstance(loaded, list) else []
        origin = OllamaManifest(
            name=name,
            path=str(path),
            digest=hashlib.sha256(raw).hexdigest(),
            size=size,
            template="".join(self._text(t) for t in by_type.get(MEDIA_TEMPLATE, [])[-1:]),
            system="".join(self._text(t) for t in by_type.get(MEDIA_SYSTEM, [])[-1:]),
            license="\n".join(licenses),
            licenses=licenses,
            messages=tuple(messages),
            requires=str(config.get("requires") or ""),
            family=str(config.get("model_family") or ""),
            families=tuple(str(f) for f in families) if isinstance(families, list) else (),
            parameter_size=str(config.get("model_type") or ""),
            quantization_level=str(config.get("file_type") or ""),
        )
        return ModelSpec(
            name=name.display(),
            path=str(weights),
            adapters=adapters,
            projector=projectors[0] if projectors else None,
            size=size,
            modified=stat.st_mtime,
            defaults=tuple(sorted(defaults.items())),
            system=origin.system,
            origin=origin,
        )

    def _config(self, manifest: dict[str, Any]) -> dict[str, Any]:
        config = manifest.get("config")
        if not isinstance(config, dict):
            return {}
        try:
            data = json.loads(self._text(config) or "{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def resolve(self, name: str) -> ModelSpec:
        """The model ``name``: its manifest's path as typed (a stat), else a case-blind search."""
        wanted = parse_name(name)
        # A string, not a Path: pathlib interns every part it parses, and a name interned for
        # one request and freed after it is a dead entry in the interpreter's table of interned
        # strings (the model store's module docstring says what that costs).
        direct = os.path.join(self.root, "manifests", wanted.host, wanted.namespace, wanted.model, wanted.tag)
        if os.path.isfile(direct):
            return self._cached_load(wanted, direct)
        entry = self._index().get(wanted.key)
        if entry is None:
            raise ModelNotFound(name)
        return self._cached_load(*entry)

    def _cached_load(self, name: OllamaName, path: str | Path) -> ModelSpec:
        """:meth:`_load`, reused while the manifest file is unchanged (layers are content-addressed)."""
        stat = os.stat(path)
        key = (os.fspath(path), stat.st_mtime_ns, stat.st_size)
        spec = _LOADED.get(key)
        if spec is None or not os.path.isfile(spec.path):
            spec = self._load(name, Path(path))
            if len(_LOADED) >= 1024:
                _LOADED.clear()
            _LOADED[key] = spec
        return spec

    def list(self) -> list[ModelSpec]:
        specs = []
        for name, path in self._index().values():
            try:
                specs.append(self._cached_load(name, path))
            except (BadRequest, OSError) as exc:
                log.warning("Ollama store %s: skipping %s: %s", self.root, name.display(), getattr(exc, "message", exc))
        return specs
