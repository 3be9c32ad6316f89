"""Write an Ollama model store (manifests and blobs) as ``ollama pull`` would, for tests.

``add_ollama_model(root, "llama3.2:1b", gguf)`` writes ``blobs/sha256-<hex>`` for the GGUF (a
hard link when possible, else a copy), for each text/params layer and for the config, and the
manifest ``manifests/registry.ollama.ai/library/llama3.2/1b``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from trioshed.models import ollama_store as o


def _blob(root: Path, data: bytes | None = None, *, file: Path | None = None) -> tuple[str, int]:
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if file is not None:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        target = blobs / f"sha256-{h.hexdigest()}"
        if not target.exists():
            try:
                os.link(file, target)
            except OSError:
                shutil.copyfile(file, target)
        return f"sha256:{h.hexdigest()}", file.stat().st_size
    assert data is not None
    digest = hashlib.sha256(data).hexdigest()
    (blobs / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}", len(data)


def add_ollama_model(
    root: Path,
    name: str,
    gguf: Path,
    *,
    params: dict[str, Any] | None = None,
    template: str | None = None,
    system: str | None = None,
    projector: Path | None = None,
    adapters: tuple[Path, ...] = (),
    config: dict[str, Any] | None = None,
) -> Path:
    """Add model ``name`` (Ollama's name syntax) to the store at ``root``; returns the manifest."""
    parsed = o.parse_name(name)
    layers: list[dict[str, Any]] = []

    def layer(media: str, data: bytes | None = None, file: Path | None = None) -> None:
        digest, size = _blob(root, data, file=file)
        layers.append({"mediaType": media, "digest": digest, "size": size})

    layer(o.MEDIA_MODEL, file=gguf)
    for adapter in adapters:
        layer(o.MEDIA_ADAPTER, file=adapter)
    if projector is not None:
        layer(o.MEDIA_PROJECTOR, file=projector)
    if template is not None:
        layer(o.MEDIA_TEMPLATE, template.encode())
    if system is not None:
        layer(o.MEDIA_SYSTEM, system.encode())
    if params is not None:
        layer(o.MEDIA_PARAMS, json.dumps(params).encode())
    config_data = json.dumps(
        config if config is not None else {"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
                                           "model_type": "1M", "file_type": "F32", "architecture": "amd64", "os": "linux"}
    ).encode()  # fmt: skip
    config_digest, config_size = _blob(root, config_data)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": config_digest, "size": config_size},
        "layers": layers,
    }
    path = root / "manifests" / parsed.host / parsed.namespace / parsed.model / parsed.tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path
