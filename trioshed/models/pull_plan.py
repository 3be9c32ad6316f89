"""What a pull fetches and where it goes: names, manifests, Hugging Face file choice, progress.

No I/O and no trio (the house rule for decisions): :mod:`trioshed.models.pull` fetches what
these functions ask for and writes what they return.

Two sources, told apart by the name's host:

* **an Ollama registry** (``llama3.2:1b``, ``user/model:tag``, ``registry.ollama.ai/...``,
  ``host:5000/ns/model:tag``): ``GET /v2/<ns>/<model>/manifests/<tag>`` (Accept: the Docker v2
  manifest type), then every layer and the config by ``GET /v2/<ns>/<model>/blobs/<digest>``, as
  Ollama's own client does (server/images.go, server/download.go);
* **a Hugging Face GGUF repository** (``hf.co/USER/REPO:QUANT``, also typed
  ``huggingface.co/...``): the repository's file list (``GET /api/models/USER/REPO/tree/main``),
  the GGUF chosen for the quant by :func:`choose_hf_files`, downloaded from
  ``/USER/REPO/resolve/main/<path>`` and checked against the sha256 Hugging Face lists for it
  (its LFS ``oid``). The manifest trioshed writes for it is an Ollama one, so the model is named
  as Ollama names it (``hf.co/USER/REPO:QUANT``) and read by the same store reader.

Everything taken from a registry is validated here before it names a file: digests are
``sha256:`` and 64 lowercase hex digits, sizes are non-negative integers below :data:`MAX_LAYER`,
name parts are :func:`~trioshed.models.ollama_store.parse_name`'s safe characters (no ``/``, no
``..``), Hugging Face paths are plain relative paths.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from trioshed.errors import BadRequest, ModelNotFound, NotSupported, RegistryError
from trioshed.models import ollama_store as o

PULLED = "pulled"  # the pull store's folder inside the first folder store

HF_HOSTS = ("hf.co", "huggingface.co")
HF_HOST = "hf.co"  # the host Ollama writes in the names (and manifest paths) of such models
#: Ollama's manifest type, asked for in the Accept header and written into every manifest.
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
MAX_MANIFEST = 1 << 20  # a manifest (JSON) larger than 1 MiB is refused unread
MAX_LAYER = 1 << 41  # 2 TiB: no layer of a real model is larger
MAX_TEXT_LAYER = 16 << 20  # a template/params/system/license/config layer above 16 MiB is refused
#: Quants tried, in order, when an HF name has no tag (or ``latest``), as llama.cpp's ``-hf`` does.
HF_DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
#: Files of a GGUF repository that are not a model to serve (llama.cpp skips the same).
_NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HF_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*$")
_TEXT_MEDIA = {o.MEDIA_PARAMS, o.MEDIA_TEMPLATE, o.MEDIA_SYSTEM, o.MEDIA_LICENSE, "application/vnd.ollama.image.messages"}


@dataclass(frozen=True)
class Target:
    """A name to pull: where it comes from (``"ollama"`` or ``"hf"``) and how it is stored."""

    name: o.OllamaName
    source: str

    @property
    def display(self) -> str:
        return self.name.display()

    @property
    def repository(self) -> str:
        """``<namespace>/<model>``: the path part of the registry's URLs."""
        return f"{self.name.namespace}/{self.name.model}"


def parse_target(name: object) -> Target:
    """A pull name: Ollama's syntax; ``hf.co/USER/REPO[:QUANT]`` (or ``huggingface.co/...``) is a
    Hugging Face repository. An unsafe name is a 400 (it never reaches a path)."""
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("model is required")
    if "@" in name:
        raise BadRequest(f"invalid model name {name!r}: pulling by digest (@sha256:...) is not supported; name a tag")
    parsed = o.parse_name(name)
    if parsed.host.lower() in HF_HOSTS:
        return Target(o.OllamaName(HF_HOST, parsed.namespace, parsed.model, parsed.tag), "hf")
    return Target(parsed, "ollama")


def manifest_path_parts(name: o.OllamaName) -> tuple[str, str, str, str]:
    """The four path parts of a manifest under ``manifests/``; each checked again (defence in
    depth: a part with a ``/``, ``..`` or a NUL never becomes a path)."""
    parts = (name.host, name.namespace, name.model, name.tag)
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part or len(part) > 255:
            raise BadRequest(f"invalid model name part {part!r}")
    return parts


# -- manifests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # "sha256:<64 hex>"
    size: int
    url: str = ""  # where to fetch it (filled in by the fetcher for HF files); "" = the registry's blob URL
    data: bytes | None = None  # a layer made here (an HF model's config): written, not fetched

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    @property
    def short(self) -> str:
        """The 12 hex digits Ollama's progress shows (``pulling 96c415656d37``)."""
        return self.hex[:12]


@dataclass(frozen=True)
class Plan:
    """A manifest to write once every layer it names is in the store."""

    target: Target
    manifest: bytes  # the exact bytes written to manifests/...
    layers: tuple[Layer, ...]  # the config last, as Ollama fetches it

    @property
    def total(self) -> int:
        return sum(layer.size for layer in self.layers)


def check_digest(digest: object) -> str:
    """``sha256:<64 lowercase hex>``, or a 502 naming the bad value."""
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not _HEX64.match(digest[7:]):
        raise RegistryError(f"the registry sent an invalid digest {str(digest)[:100]!r}; nothing was kept")
    return digest


def _layer(raw: object, where: str) -> Layer:
    if not isinstance(raw, dict):
        raise RegistryError(f"the registry's manifest has an invalid {where}; nothing was kept")
    media = raw.get("mediaType")
    size = raw.get("size")
    if not isinstance(media, str) or not media or len(media) > 200:
        raise RegistryError(f"the registry's manifest has a {where} without a media type; nothing was kept")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_LAYER:
        raise RegistryError(f"the registry's manifest has a {where} with an invalid size {size!r}; nothing was kept")
    if (media in _TEXT_MEDIA or where == "config") and size > MAX_TEXT_LAYER:
        raise RegistryError(f"the registry's manifest has a {media} layer of {size} bytes (the limit is {MAX_TEXT_LAYER}); nothing was kept")
    return Layer(media, check_digest(raw.get("digest")), size)


def parse_manifest(target: Target, raw: bytes) -> Plan:
    """A registry's manifest, validated: schema 2, a config, layers with digests and sizes, one
    model layer. The bytes are kept as they came (their sha256 is the digest /api/tags shows)."""
    if len(raw) > MAX_MANIFEST:
        raise RegistryError(f"the manifest of '{target.display}' is larger than {MAX_MANIFEST} bytes; nothing was kept")
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise RegistryError(f"the manifest of '{target.display}' is not JSON; nothing was kept") from None
    if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2:
        raise RegistryError(f"the manifest of '{target.display}' is not a schema 2 manifest; nothing was kept")
    layers_raw = manifest.get("layers")
    if not isinstance(layers_raw, list) or not layers_raw or len(layers_raw) > 1000:
        raise RegistryError(f"the manifest of '{target.display}' has no layers; nothing was kept")
    layers = [_layer(layer, "layer") for layer in layers_raw]
    if not any(layer.media_type == o.MEDIA_MODEL for layer in layers):
        kinds = sorted({layer.media_type for layer in layers})
        raise NotSupported(
            f"'{target.display}' has no GGUF model layer ({o.MEDIA_MODEL}; it has {', '.join(kinds)}): "
            "llama-server cannot serve it"
        )
    config = _layer(manifest.get("config"), "config")
    unique: dict[str, Layer] = {}
    for layer in (*layers, config):
        unique.setdefault(layer.digest, layer)
    return Plan(target, bytes(raw), tuple(unique.values()))


# -- Hugging Face ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HfFile:
    path: str
    size: int
    sha256: str  # hex, from the LFS pointer; "" for a file not in LFS


def parse_hf_tree(raw: object) -> list[HfFile]:
    """Hugging Face's ``/api/models/USER/REPO/tree/<rev>`` answer: its files (not folders), with
    paths that are plain relative paths (others are dropped)."""
    if not isinstance(raw, list):
        raise RegistryError("Hugging Face's file list is not a JSON list; nothing was kept")
    files = []
    for item in raw:
        if not isinstance(item, dict) or item.get("type") != "file":
            continue
        path = item.get("path")
        if not isinstance(path, str) or not all(_HF_PATH_PART.match(p) for p in path.split("/")) or len(path) > 1000:
            continue
        lfs = item.get("lfs")
        sha = lfs.get("oid") if isinstance(lfs, dict) else None
        size = lfs.get("size") if isinstance(lfs, dict) else item.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_LAYER:
            continue
        files.append(HfFile(path, size, sha if isinstance(sha, str) and _HEX64.match(sha) else ""))
    return sorted(files, key=lambda f: f.path)


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_model_gguf(path: str) -> bool:
    name = _basename(path).lower()
    return name.endswith(".gguf") and not any(word in name for word in _NOT_A_MODEL)


def _matches_quant(path: str, quant: str) -> bool:
    """The quant appears in the file name as a word of its own, in any letter case:
    ``Q4_K_M`` matches ``model-Q4_K_M.gguf`` and ``model.q4_k_m.gguf``, not ``model-IQ4_K_M.gguf``
    or ``model-Q4_K_M_L.gguf``."""
    pattern = rf"(?:^|[-._]){re.escape(quant)}(?:[-.]|$)"
    return re.search(pattern, _basename(path), re.IGNORECASE) is not None


@dataclass(frozen=True)
class HfChoice:
    model: HfFile
    projector: HfFile | None
    quant: str  # the quant the model file was chosen for ("" when the only GGUF was taken)


def choose_hf_files(target: Target, files: list[HfFile]) -> HfChoice:
    """The GGUF to pull for ``hf.co/USER/REPO:TAG``.

    * TAG names a file (``...:model-Q4_K_M.gguf``): that file, any letter case.
    * TAG is a quant: the model GGUFs (files ending ``.gguf`` that are not ``mmproj``,
      ``imatrix`` or a draft-model sidecar) whose file name has the quant as a word of its own,
      in any letter case. Exactly one such file: that one. Several: 400 listing them (name one by
      its file name as the tag). A split GGUF (``-00001-of-00003.gguf``): 501, trioshed's store
      holds one file per model.
    * no TAG (or ``latest``): ``Q4_K_M``, else ``Q8_0``, else the repository's only model GGUF;
      with several and neither quant, 400 listing them.

    The projector (``mmproj*.gguf``): the one whose name has the same quant, else ``F16``, else
    the first by name; none when the repository has none.
    """
    ggufs = [f for f in files if is_model_gguf(f.path)]
    if not ggufs:
        raise not_found(target, f"hf.co/{target.repository} has no GGUF model file")
    tag = target.name.tag
    by_name = [f for f in files if _basename(f.path).lower() == tag.lower() and f.path.lower().endswith(".gguf")]
    quant = ""
    if by_name:
        chosen = by_name
    elif tag.lower() != o.DEFAULT_TAG:
        quant = tag
        chosen = [f for f in ggufs if _matches_quant(f.path, tag)]
        if not chosen:
            raise not_found(target, f"no GGUF file for quant '{tag}' in hf.co/{target.repository}; it has: {_listing(ggufs)}")
    else:
        chosen = []
        for default in HF_DEFAULT_QUANTS:
            chosen = [f for f in ggufs if _matches_quant(f.path, default)]
            if chosen:
                quant = default
                break
        else:
            chosen = ggufs if len({_split_base(f.path) for f in ggufs}) == 1 else []
            if not chosen:
                raise BadRequest(
                    f"hf.co/{target.repository} has several GGUF files and none is Q4_K_M or Q8_0: "
                    f"{_listing(ggufs)}; name the quant as the tag (hf.co/{target.repository}:QUANT)"
                )
    if any(_SPLIT.search(f.path) for f in chosen):
        raise NotSupported(
            f"hf.co/{target.repository}:{tag} is a split GGUF ({_listing(chosen)}); trioshed's store "
            "holds one file per model: merge the parts with llama-gguf-split --merge and copy the "
            "result into TRIOSHED_MODELS"
        )
    if len(chosen) > 1:
        raise BadRequest(
            f"several GGUF files of hf.co/{target.repository} match '{tag}': {_listing(chosen)}; "
            f"name one by its file name as the tag (hf.co/{target.repository}:{_basename(chosen[0].path)})"
        )
    model = chosen[0]
    if not model.sha256:
        raise RegistryError(f"hf.co/{target.repository}: {model.path} has no sha256 (not stored in LFS); trioshed only keeps verified files")
    projectors = [f for f in files if "mmproj" in _basename(f.path).lower() and f.path.lower().endswith(".gguf") and f.sha256]
    projector = None
    if projectors:
        for wanted in (quant, "F16"):
            hits = [f for f in projectors if wanted and _matches_quant(f.path, wanted)]
            if hits:
                projector = hits[0]
                break
        else:
            projector = projectors[0]
    return HfChoice(model, projector, quant)


def not_found(target: Target, detail: str) -> ModelNotFound:
    """A 404 for a pull, saying what the registry lacks."""
    error = ModelNotFound(target.display)
    error.message = f"pull model '{target.display}': {detail}"
    error.args = (error.message,)
    return error


def _split_base(path: str) -> str:
    return _SPLIT.sub("", path)


def _listing(files: list[HfFile]) -> str:
    names = [f.path for f in files]
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")


def hf_plan(target: Target, choice: HfChoice, *, model_url: str, projector_url: str = "") -> Plan:
    """The Ollama manifest trioshed writes for a Hugging Face GGUF: the model layer, the projector
    layer if any, and a config made here (format, the quant as Ollama's ``file_type``)."""
    layers = [Layer(o.MEDIA_MODEL, f"sha256:{choice.model.sha256}", choice.model.size, model_url)]
    if choice.projector is not None:
        layers.append(Layer(o.MEDIA_PROJECTOR, f"sha256:{choice.projector.sha256}", choice.projector.size, projector_url))
    config_data = json.dumps(
        {"model_format": "gguf", "file_type": choice.quant.upper(), "source": f"hf.co/{target.repository}/{choice.model.path}"},
        sort_keys=True,
    ).encode()
    config = config_layer(config_data)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_V2,
        "config": {"mediaType": CONFIG_V1, "digest": config.digest, "size": config.size},
        "layers": [{"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in layers],
    }
    unique: dict[str, Layer] = {}
    for layer in (*layers, config):
        unique.setdefault(layer.digest, layer)
    return Plan(target, json.dumps(manifest, indent=None).encode(), tuple(unique.values()))


def config_layer(data: bytes) -> Layer:
    return Layer(CONFIG_V1, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), data=data)


# -- HTTP details ----------------------------------------------------------------------------


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate: Bearer realm="https://x/token",service="s",scope="repository:a:pull"``
    → ``("bearer", {"realm": ..., "service": ..., "scope": ...})``."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)="([^"]*)"', rest)}
    return scheme.lower(), params


def content_range_start(header: str | None, total: int) -> int | None:
    """The first byte of ``Content-Range: bytes START-END/TOTAL`` when it is consistent with a
    blob of ``total`` bytes; None otherwise (then the answer is not a resumable part)."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (header or "").strip())
    if not match:
        return None
    start, end = int(match.group(1)), int(match.group(2))
    whole = match.group(3)
    if end != total - 1 or start > end or (whole != "*" and int(whole) != total):
        return None
    return start


def bytes_to_fetch(plan: Plan, present: dict[str, int]) -> int:
    """The bytes still to download: every layer not complete in the store, less the part of it
    already downloaded (``present`` maps a digest to the bytes on disk: a complete blob or a
    partial one)."""
    return sum(max(0, layer.size - present.get(layer.digest, 0)) for layer in plan.layers if layer.data is None)


# -- progress (Ollama's ProgressResponse) ----------------------------------------------------


def progress(status: str, layer: Layer | None = None, completed: int | None = None) -> dict[str, Any]:
    """One line of /api/pull's stream, in Ollama's shape: ``{"status": "pulling manifest"}``, or
    ``{"status": "pulling 96c415656d37", "digest": "sha256:…", "total": N, "completed": M}``."""
    if layer is None:
        return {"status": status}
    return {"status": status, "digest": layer.digest, "total": layer.size, "completed": layer.size if completed is None else completed}
