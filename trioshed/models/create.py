"""``/api/create`` and ``trioshed create``: a model made from files, another model, or both, written
into trioshed's Ollama-layout store (``pulled/``) as ``ollama create`` writes it.

A create is two steps, as a pull is, so that the HTTP edge answers with the right status before
it streams:

1. :meth:`Creator.prepare`: the request checked whole (:func:`parse_request`: Ollama's JSON fields,
   or the older ``modelfile`` text), the base resolved (``from`` a model: its layers; ``files``:
   uploaded blobs, each GGUF sorted into model, projector or adapter by its header), the
   template parsed, the parameters typed. A bad field is a 400 naming it, ``from`` a model that
   is not here a 404, a blob not uploaded a 400. Nothing is written.
2. :meth:`Creator.run`: progress in Ollama's shape (``using existing layer sha256:…``,
   ``creating new layer sha256:…``, ``writing manifest``, ``success``) while the new layers (text,
   params, the config) are written as blobs and the manifest last, atomically. A failure removes
   the blobs this create added: the store is as it was. The layers a replaced manifest named and
   nothing names any more are removed after it (as Ollama prunes them); a runner already serving
   the old model keeps its open file until it is unloaded.

The server never reads a path a client sends: ``files`` and ``adapters`` map names to digests of
blobs uploaded with ``POST /api/blobs/:digest``; a Modelfile's ``FROM ./file`` is read by the
client (``trioshed create`` uploads it), and on the server only a ``…/sha256-<hex>`` path (what
``/api/show`` writes) is understood, as that blob's digest.
"""

from __future__ import annotations

import errno
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from trioshed.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    InsufficientStorage,
    ModelNotFound,
    NotSupported,
    TrioshedError,
)
from trioshed.models import modelfile as mf
from trioshed.models import ollama_store as o
from trioshed.models.blobs import (
    blob_path,
    digest_hex,
    free_space,
    import_file,
    write_blob,
    write_manifest,
)
from trioshed.models.gguf_meta import GGUFError, human_params, read_metadata
from trioshed.models.pull_plan import CONFIG_V1, MANIFEST_V2, manifest_path_parts
from trioshed.models.store import ModelStore
from trioshed.models.stores import Stores, manifest_blobs, prune_blobs
from trioshed.models.writer import Report, StoreWriter

log = logging.getLogger(__name__)

MEDIA_MESSAGES = o.MEDIA_MESSAGES
#: The order layers are written in: the same request always gives the same manifest.
_ORDER = (o.MEDIA_MODEL, o.MEDIA_PROJECTOR, o.MEDIA_ADAPTER, o.MEDIA_TEMPLATE, o.MEDIA_SYSTEM, o.MEDIA_PARAMS,
          MEDIA_MESSAGES, o.MEDIA_LICENSE)  # fmt: skip
_FILE_NAME = re.compile(r"^[^/\\\0]{1,255}$")
_FIELDS = {"model", "name", "stream", "quantize", "quantization", "from", "files", "adapters", "template", "license",
           "system", "parameters", "messages", "modelfile", "path", "insecure", "requires"}  # fmt: skip


@dataclass(frozen=True)
class Request:
    """A create request, checked (no I/O)."""

    name: o.OllamaName
    base: str | None = None  # "from": a model's name
    files: dict[str, str] = field(default_factory=dict)  # name -> digest
    adapters: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    licenses: list[str] | None = None
    parameters: dict[str, object] | None = None
    messages: list[dict[str, str]] | None = None
    quantize: str | None = None
    requires: str | None = None


@dataclass(frozen=True)
class _Layer:
    media_type: str
    digest: str
    size: int


@dataclass
class Prepared:
    request: Request
    layers: list[_Layer]  # existing blobs, in order
    texts: list[tuple[str, bytes]]  # new layers to write (media type, bytes)
    config: dict[str, Any]
    imports: list[tuple[str, Path]] = field(default_factory=list)  # (media type, a store file to import)


def _text(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f'"{key}" must be text')
    return value


def _digest_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(f'"{key}" must map file names to digests ({{"model.gguf": "sha256:..."}})')
    for name, digest in value.items():
        if not _FILE_NAME.match(name) or name in (".", ".."):
            raise BadRequest(f'"{key}": invalid file name {name[:80]!r}: a name, not a path')
        digest_hex(digest)
    return dict(value)


def parse_request(body: dict[str, Any]) -> Request:
    """Ollama's ``CreateRequest`` checked: a 400 naming the field that is wrong."""
    name_text = body.get("model") or body.get("name")
    if not isinstance(name_text, str) or not name_text.strip():
        raise BadRequest('"model" is required')
    if "@" in name_text:
        raise BadRequest(f"invalid model name {name_text!r}")
    name = o.parse_name(name_text)
    manifest_path_parts(name)
    if name.host.lower() in ("hf.co", "huggingface.co"):
        raise BadRequest(f"invalid model name {name_text!r}: hf.co names are Hugging Face's; choose another")
    text = _text(body, "modelfile")
    if body.get("path") and text is None:
        raise BadRequest('"path" is not supported: send the Modelfile\'s text as "modelfile", or use the fields ("from", "files", ...)')
    fields = dict(body)
    if text is not None:  # the older request: the Modelfile's text; the JSON fields given win
        fields = {**mf.server_fields(text), **{k: v for k, v in body.items() if k != "modelfile" and v is not None}}
    base = _text(fields, "from")
    if base is not None:
        match = mf.BLOB_IN_PATH.search(base.strip())
        if match:  # FROM @sha256:... or a path /api/show wrote: that blob, by its digest only
            fields["files"] = {**(fields.get("files") or {}), f"sha256-{match.group(1)}.gguf": f"sha256:{match.group(1)}"}
            base = None
        elif _looks_like_path(base):
            raise BadRequest(f"from {base[:80]!r} is a file path, which the server does not read: upload the file "
                             "(POST /api/blobs/sha256:<hex>) and name it in \"files\", or use 'trioshed create -f'")  # fmt: skip
        else:
            parsed = o.parse_name(base)
            manifest_path_parts(parsed)
    files = _digest_map(fields, "files")
    adapters = _digest_map(fields, "adapters")
    if not base and not files:
        raise BadRequest("neither 'from' or 'files' was specified")
    license_value = fields.get("license")
    licenses: list[str] | None
    if license_value is None:
        licenses = None
    elif isinstance(license_value, str):
        licenses = [license_value]
    elif isinstance(license_value, list) and all(isinstance(x, str) for x in license_value):
        licenses = list(license_value)
    else:
        raise BadRequest('"license" must be text or a list of texts')
    params = fields.get("parameters")
    parameters: dict[str, object] | None = None
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest('"parameters" must be an object')
        parameters = {str(k): mf.parameter_value(str(k), v) for k, v in params.items() if v is not None}
    messages = fields.get("messages")
    checked: list[dict[str, str]] | None = None
    if messages is not None:
        if not isinstance(messages, list):
            raise BadRequest('"messages" must be a list')
        checked = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise BadRequest('each of "messages" must be {"role": ..., "content": "..."}')
            if m.get("role") not in mf.ROLES:
                raise BadRequest('message role must be one of "system", "user", or "assistant"')
            checked.append({"role": str(m["role"]), "content": str(m.get("content") or "")})
    template = _text(fields, "template")
    if template is not None:
        mf.check_template(template)
    quantize = fields.get("quantize") or fields.get("quantization")
    if quantize is not None and not isinstance(quantize, str):
        raise BadRequest('"quantize" must be text (e.g. "q4_K_M")')
    requires = _text(fields, "requires")
    return Request(name=name, base=base, files=files, adapters=adapters, template=template, system=_text(fields, "system"),
                   licenses=licenses, parameters=parameters, messages=checked, quantize=quantize or None,
                   requires=requires)  # fmt: skip


def _looks_like_path(text: str) -> bool:
    t = text.strip()
    return t.startswith((".", "/", "~", "\\")) or "\\" in t or t.lower().endswith((".gguf", ".safetensors", ".bin")) or (
        len(t) > 1 and t[1] == ":"
    )


class Creator:
    """Creates models in the Ollama-layout store at ``root`` (a folder store's ``pulled/``)."""

    def __init__(self, stores: Stores, writer: StoreWriter | None = None) -> None:
        self.stores = stores
        #: the store's one writer: a create holds its lock while it writes (the prune sees every manifest)
        self.writer = writer or StoreWriter()

    def _root(self) -> Path:
        root = self.stores.pull_root
        if root is None:
            raise Forbidden("create needs a folder store to write into (its pulled/ folder); every folder in "
                            "TRIOSHED_MODELS is a read-only Ollama store")  # fmt: skip
        return root

    async def prepare(self, body: dict[str, Any]) -> Prepared:
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            log.debug("create: ignoring fields %s", unknown)
        request = parse_request(body)
        return await trio.to_thread.run_sync(self._prepare, request)

    def _prepare(self, request: Request) -> Prepared:
        root = self._root()
        self._check_not_shadowed(request.name)
        layers: list[_Layer] = []
        imports: list[tuple[str, Path]] = []
        texts: dict[str, list[bytes]] = {}
        config: dict[str, Any] = {}
        model_meta_path: Path | None = None
        if request.base:
            spec = self.stores.resolve(request.base)  # 404 for a model that is not here
            origin = spec.origin
            if isinstance(origin, o.OllamaManifest):
                manifest = json.loads(Path(origin.path).read_bytes())
                elsewhere = Path(origin.path).parents[4] != root  # another Ollama store: its blobs are imported
                for raw in manifest.get("layers") or []:
                    layer = _Layer(str(raw.get("mediaType")), str(raw.get("digest")), int(raw.get("size") or 0))
                    if layer.media_type in (o.MEDIA_TEMPLATE, o.MEDIA_SYSTEM, o.MEDIA_PARAMS, MEDIA_MESSAGES, o.MEDIA_LICENSE):
                        texts.setdefault(layer.media_type, []).append(_store_blob(origin.path, layer.digest).read_bytes())
                    elif elsewhere:
                        imports.append((layer.media_type, _store_blob(origin.path, layer.digest)))
                    else:
                        layers.append(layer)
                cfg = manifest.get("config")
                if isinstance(cfg, dict):
                    try:
                        config = json.loads(_store_blob(origin.path, str(cfg.get("digest"))).read_bytes())
                    except (OSError, ValueError):
                        config = {}
                model_meta_path = Path(spec.path)
            else:  # a folder-store model: its files are imported into the store
                imports.append((o.MEDIA_MODEL, Path(spec.path)))
                imports += [(o.MEDIA_ADAPTER, Path(a)) for a in spec.adapters]
                if spec.projector:
                    imports.append((o.MEDIA_PROJECTOR, Path(spec.projector)))
                if spec.system:
                    texts[o.MEDIA_SYSTEM] = [spec.system.encode()]
                if spec.defaults:
                    texts[o.MEDIA_PARAMS] = [_params_json(dict(spec.defaults))]
                model_meta_path = Path(spec.path)
        for file_name, digest in request.files.items():
            path = blob_path(root, digest)
            if not path.is_file():
                raise BadRequest(f'file "{file_name}" names blob {digest}, which is not in the store: upload it first (POST /api/blobs/{digest})')
            if file_name.lower().endswith((".safetensors", ".bin", ".pt", ".pth")) or not _is_gguf(path):
                raise NotSupported(f'file "{file_name}" is not a GGUF file: trioshed serves GGUF models only; convert it with '
                                   "llama.cpp's convert_hf_to_gguf.py and create from the .gguf")  # fmt: skip
            kind = _gguf_kind(path)
            layer = _Layer(kind, digest, path.stat().st_size)
            if kind == o.MEDIA_MODEL:
                layers = [x for x in layers if x.media_type != o.MEDIA_MODEL]
                imports = [x for x in imports if x[0] != o.MEDIA_MODEL]
                model_meta_path = path
                config = {}
            elif kind == o.MEDIA_PROJECTOR:
                layers = [x for x in layers if x.media_type != o.MEDIA_PROJECTOR]
            layers.append(layer)
        if request.adapters:
            layers = [x for x in layers if x.media_type != o.MEDIA_ADAPTER]
            imports = [x for x in imports if x[0] != o.MEDIA_ADAPTER]
        for file_name, digest in request.adapters.items():
            path = blob_path(root, digest)
            if not path.is_file():
                raise BadRequest(f'adapter "{file_name}" names blob {digest}, which is not in the store: upload it first (POST /api/blobs/{digest})')
            if not _is_gguf(path) or _gguf_kind(path) != o.MEDIA_ADAPTER:
                raise BadRequest(f'adapter "{file_name}" is not a GGUF LoRA adapter (general.type = adapter); convert it with '
                                 "llama.cpp's convert_lora_to_gguf.py")  # fmt: skip
            layers.append(_Layer(o.MEDIA_ADAPTER, digest, path.stat().st_size))
        if model_meta_path is None or (not any(x.media_type == o.MEDIA_MODEL for x in layers) and not imports):
            raise BadRequest("no model file: \"files\" names only adapters or projectors; add the model's GGUF (or use \"from\")")
        meta = read_metadata(model_meta_path)
        if request.quantize:
            quant = meta.quantization
            if quant.upper() not in ("F16", "F32", "BF16"):
                raise BadRequest("quantization is only supported for F16 and F32 models")
            raise NotSupported(f"trioshed does not quantize models; quantize with llama.cpp's llama-quantize "
                               f"(llama-quantize model.gguf model-{request.quantize}.gguf {request.quantize.upper()}) and create from the result")  # fmt: skip
        if request.template is not None:
            texts[o.MEDIA_TEMPLATE] = [request.template.encode()] if request.template else []
        if request.system is not None:
            texts[o.MEDIA_SYSTEM] = [request.system.encode()] if request.system else []
        if request.parameters is not None:
            merged: dict[str, object] = {}
            for old in texts.get(o.MEDIA_PARAMS, []):
                try:
                    loaded = json.loads(old)
                    merged.update(loaded if isinstance(loaded, dict) else {})
                except ValueError:
                    pass
            merged.update(request.parameters)
            texts[o.MEDIA_PARAMS] = [_params_json(merged)] if merged else []
        if request.messages is not None:
            texts[MEDIA_MESSAGES] = [json.dumps(request.messages, ensure_ascii=False, separators=(",", ":")).encode()] if request.messages else []
        if request.licenses is not None:
            texts[o.MEDIA_LICENSE] = [t.encode() for t in request.licenses]
        if not config:
            config = {
                "model_format": "gguf",
                "model_family": meta.architecture,
                "model_families": [meta.architecture],
                "model_type": human_params(meta.parameter_count) if meta.parameter_count else "",
                "file_type": meta.quantization,
            }
        if request.requires:
            config["requires"] = request.requires
        text_layers = [(media, data) for media in _ORDER for data in texts.get(media, [])]
        return Prepared(request, layers, text_layers, config, imports)

    def _check_not_shadowed(self, name: o.OllamaName) -> None:
        """409 for a name a folder store serves (its GGUF file or a ``models.toml`` entry): the
        created model would be hidden behind it."""
        if name.host.lower() != o.DEFAULT_HOST or name.namespace.lower() != o.DEFAULT_NAMESPACE:
            return
        for backend in self.stores.backends():
            if not isinstance(backend, ModelStore):
                continue
            try:
                backend.resolve(name.display())
            except (ModelNotFound, BadRequest):
                continue
            raise Conflict(f"'{name.display()}' is a model of the folder store {backend.root.name}/ (a GGUF file or a "
                           "models.toml entry), which would hide the created one: choose another name or delete it first")  # fmt: skip

    async def run(self, prepared: Prepared, report: Report) -> None:
        """Report progress lines while the layers and the manifest are written; on an error
        (cancellation included) the blobs this create added are removed again and the error
        raised. Holds the store writer's lock throughout, in this one task (``report`` is a
        channel send); run it as a writer task (:meth:`StoreWriter.start`)."""
        root = self._root()
        async with self.writer.lock:
            created: list[str] = []
            try:
                await trio.to_thread.run_sync(_check_present, root, prepared.layers)
                layers = list(prepared.layers)
                for media, path in prepared.imports:
                    await report({"status": f"copying file {path.name}"})
                    digest, size, new = await trio.to_thread.run_sync(import_file, root, path)
                    if new:
                        created.append(digest)
                    layers.append(_Layer(media, digest, size))
                for media, data in prepared.texts:
                    digest, new = await trio.to_thread.run_sync(write_blob, root, data)
                    if new:
                        created.append(digest)
                    layers.append(_Layer(media, digest, len(data)))
                layers = _ordered(layers)
                for layer in layers:
                    verb = "creating new layer" if layer.digest in created else "using existing layer"
                    await report({"status": f"{verb} {layer.digest}"})
                config = {**prepared.config, "rootfs": {"type": "layers", "diff_ids": [x.digest for x in layers]}}
                config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
                config_digest, new = await trio.to_thread.run_sync(write_blob, root, config_bytes)
                if new:
                    created.append(config_digest)
                manifest = {
                    "schemaVersion": 2,
                    "mediaType": MANIFEST_V2,
                    "config": {"mediaType": CONFIG_V1, "digest": config_digest, "size": len(config_bytes)},
                    "layers": [{"mediaType": x.media_type, "digest": x.digest, "size": x.size} for x in layers],
                }
                await report({"status": "writing manifest"})
                await trio.to_thread.run_sync(self._write, root, prepared.request.name, json.dumps(manifest).encode())
            except BaseException as exc:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_remove_blobs, root, created)
                if isinstance(exc, OSError):
                    if exc.errno == errno.ENOSPC:
                        raise InsufficientStorage(sum(x.size for x in prepared.layers), free_space(root), str(root)) from None
                    raise TrioshedError(f"cannot write the model into the store: {exc.strerror}; check the folder's permissions") from None
                raise
        await report({"status": "success"})

    def _write(self, root: Path, name: o.OllamaName, data: bytes) -> None:
        parts = manifest_path_parts(name)
        existing = _existing_manifest(root, name)
        replaced = manifest_blobs(existing) if existing is not None else set()
        if existing is not None and existing.relative_to(root / "manifests").parts != parts:
            existing.unlink()  # the same name in another letter case: replaced
        try:
            write_manifest(root, parts, data)
        except OSError as exc:
            raise TrioshedError(f"cannot write the manifest: {exc.strerror}; check the folder's permissions") from None
        keep = {Path(p).name for e in self.stores.catalogue().entries for p in (e.path, *e.adapters, e.projector or "") if p}
        prune_blobs(root, replaced, keep=keep | self.writer.claimed())  # the old manifest's layers nothing names any more


def _check_present(root: Path, layers: list[_Layer]) -> None:
    """The blobs the create names that were in the store when it was checked are still there
    (a delete may have removed them since; deletions wait for the lock this create holds now)."""
    for layer in layers:
        if not blob_path(root, layer.digest).is_file():
            raise BadRequest(f"blob {layer.digest} is not in the store any more (a model that used it was deleted): "
                             f"upload it again (POST /api/blobs/{layer.digest})")  # fmt: skip


def _remove_blobs(root: Path, digests: list[str]) -> None:
    for digest in digests:
        blob_path(root, digest).unlink(missing_ok=True)


def _existing_manifest(root: Path, name: o.OllamaName) -> Path | None:
    top = root / "manifests"
    for path in top.glob("*/*/*/*") if top.is_dir() else []:
        parts = path.relative_to(top).parts
        if o.OllamaName(*parts).key == name.key:
            return path
    return None


def _ordered(layers: list[_Layer]) -> list[_Layer]:
    seen: set[tuple[str, str]] = set()
    out = []
    for layer in sorted(layers, key=lambda x: _ORDER.index(x.media_type) if x.media_type in _ORDER else len(_ORDER)):
        if (layer.media_type, layer.digest) not in seen:
            seen.add((layer.media_type, layer.digest))
            out.append(layer)
    return out


def _params_json(params: dict[str, object]) -> bytes:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _store_blob(manifest_path: str, digest: str) -> Path:
    """A blob of the store that holds the manifest at ``manifest_path``."""
    path = Path(manifest_path)
    root = path.parents[4]
    return blob_path(root, digest)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_kind(path: Path) -> str:
    try:
        meta = read_metadata(path)
    except (GGUFError, OSError) as exc:
        raise BadRequest(f"{path.name[:19]}: not a readable GGUF file ({exc})") from None
    if meta.fields.get("general.type") == "adapter":
        return o.MEDIA_ADAPTER
    if meta.architecture in ("clip", "mmproj") or meta.fields.get("general.type") == "mmproj":
        return o.MEDIA_PROJECTOR
    return o.MEDIA_MODEL
