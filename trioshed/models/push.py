"""``/api/push`` and ``trioshed push``: a model of trioshed's store sent to an Ollama-protocol
registry (the Docker registry v2 API), as ``ollama push`` sends it.

For each layer and the config: ``HEAD /v2/<ns>/<model>/blobs/<digest>`` (present: skipped), else
``POST /v2/<ns>/<model>/blobs/uploads/`` (202 and a ``Location``) and ``PUT <location>?digest=…``
with the blob's bytes, streamed from disk; then ``PUT /v2/<ns>/<model>/manifests/<tag>`` with the
manifest's exact bytes, so that a pull gives the same digests. A registry that asks for a token
gets the Docker token flow pull speaks (``TRIOSHED_REGISTRY_TOKEN`` sent to its token service).

Progress in Ollama's shape: ``retrieving manifest``, ``pushing <12 hex>`` with
``digest``/``total``/``completed``, ``pushing manifest``, ``success``. The name says where:
``host/ns/model:tag`` to that host (``http://`` with ``insecure``), ``ns/model:tag`` to
``TRIOSHED_OLLAMA_REGISTRY``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import httpx
import trio

from trioshed.errors import BadRequest, RegistryError
from trioshed.models import ollama_store as o
from trioshed.models.blobs import blob_path
from trioshed.models.pull_plan import (
    MANIFEST_V2,
    Layer,
    Target,
    check_digest,
    parse_target,
    progress,
)
from trioshed.models.registry_client import Registries, Session, open_client, send, session_for
from trioshed.models.stores import Stores
from trioshed.models.writer import Report, StoreWriter

PUSH_CHUNK = 16 << 20  # bytes sent per PATCH of a blob upload (and the progress granularity)


@dataclass(frozen=True)
class Prepared:
    session: Session
    manifest: bytes
    layers: tuple[tuple[Layer, Path], ...]  # each blob and its file


async def prepare(stores: Stores, name: object, *, insecure: bool = False, registries: Registries | None = None) -> Prepared:
    """The model ``name`` found and its files checked: 400 for a bad name or an hf.co one, 404
    for a model that is not here, 400 for one trioshed cannot push (a folder-store GGUF)."""
    target = parse_target(name)
    if target.source == "hf":
        raise BadRequest("cannot push to Hugging Face: hf.co names are pulled only")

    def find() -> Prepared:
        spec = stores.resolve(target.name.display() if isinstance(name, str) else "")
        origin = spec.origin
        if not isinstance(origin, o.OllamaManifest):
            raise BadRequest(f"model '{spec.name}' is a GGUF file of the folder store, not a manifest: create it first "
                             f"(trioshed create {target.name.display()} with FROM {spec.name}) and push that")  # fmt: skip
        raw = Path(origin.path).read_bytes()
        manifest = json.loads(raw)
        root = Path(origin.path).parents[4]
        layers = []
        for item in [*(manifest.get("layers") or []), manifest.get("config") or {}]:
            digest = check_digest(item.get("digest"))
            path = blob_path(root, digest)
            if not path.is_file():
                raise BadRequest(f"model '{spec.name}' is missing its blob {digest[:19]}: pull or create it again")
            layers.append((Layer(str(item.get("mediaType")), digest, path.stat().st_size), path))
        return Prepared(session_for(Target(target.name, "ollama"), registries or Registries.from_env(), insecure=insecure), raw,
                        tuple(layers))  # fmt: skip

    return await trio.to_thread.run_sync(find)


async def run(prepared: Prepared, report: Report, writer: StoreWriter) -> None:
    """Report progress lines while each blob and then the manifest are sent. The blobs are
    claimed from the store ``writer`` meanwhile: a delete of another model sharing one leaves it."""
    async with writer.claim(path.name for _, path in prepared.layers):
        await _send_all(prepared, report)
    await report(progress("success"))


async def _send_all(prepared: Prepared, report: Report) -> None:
    session = prepared.session
    repo = f"{session.base}/v2/{session.target.repository}"
    await report(progress("retrieving manifest"))
    async with open_client(session.insecure) as client:
        for layer, path in prepared.layers:
            status = f"pushing {layer.short}"
            head = await send(client, session, "HEAD", f"{repo}/blobs/{layer.digest}")
            if head.status_code == 200:
                await report(progress(status, layer))
                continue
            if head.status_code not in (404, 401, 403):
                _refused(head, f"blob {layer.short}")
            started = await send(client, session, "POST", f"{repo}/blobs/uploads/")
            if started.status_code not in (201, 202):
                _refused(started, "the upload")
            location = started.headers.get("location")
            if not location:
                raise RegistryError("the registry started an upload without a Location; nothing was pushed")
            await report(progress(status, layer, 0))
            sent = 0
            f = await trio.to_thread.run_sync(open, path, "rb")
            try:
                while sent < layer.size:
                    chunk = await trio.to_thread.run_sync(f.read, PUSH_CHUNK)
                    if not chunk:
                        raise RegistryError(f"blob {layer.short} changed while it was pushed; create or pull it again")
                    patched = await send(client, session, "PATCH", urljoin(f"{repo}/", location), content=chunk, headers={
                        "Content-Type": "application/octet-stream", "Content-Range": f"{sent}-{sent + len(chunk) - 1}"})  # fmt: skip
                    if patched.status_code not in (202, 204):
                        _refused(patched, f"blob {layer.short}")
                    location = patched.headers.get("location") or location
                    sent += len(chunk)
                    await report(progress(status, layer, sent))
            finally:
                await trio.to_thread.run_sync(f.close)
            url = httpx.URL(urljoin(f"{repo}/", location)).copy_merge_params({"digest": layer.digest})
            put = await send(client, session, "PUT", str(url), headers={"Content-Length": "0"})
            if put.status_code not in (201, 204):
                _refused(put, f"blob {layer.short}")
        await report(progress("pushing manifest"))
        answer = await send(client, session, "PUT", f"{repo}/manifests/{session.target.name.tag}", content=prepared.manifest,
                            headers={"Content-Type": MANIFEST_V2})  # fmt: skip
        if answer.status_code not in (200, 201, 202):
            _refused(answer, "the manifest")


def _refused(response: httpx.Response, what: str) -> None:
    detail = ""
    try:
        errors = response.json().get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):
            detail = f": {str(errors[0].get('message') or errors[0].get('code'))[:200]}"
    except (ValueError, AttributeError):
        pass
    if response.status_code in (401, 403):
        raise RegistryError(f"the registry refused {what} (HTTP {response.status_code}{detail}); "
                            "set TRIOSHED_REGISTRY_TOKEN if it needs credentials")  # fmt: skip
    raise RegistryError(f"the registry answered HTTP {response.status_code} for {what}{detail}")
