"""``/api/pull`` and ``trioshed pull``: fetch a model into trioshed's own store, in Ollama's layout.

The pulled models live in ``<first folder of TRIOSHED_MODELS>/pulled/`` (``manifests/`` and
``blobs/sha256-…``, exactly what ``ollama pull`` writes), which
:class:`~trioshed.models.stores.Stores` serves with the Ollama-store reader, template, params,
projector and adapter layers included. An Ollama store named in ``TRIOSHED_MODELS`` is never
written: with no folder store there is nowhere to pull to (403).

A pull is two steps so that the HTTP edge can answer with the right status before it streams:

1. :meth:`Puller.prepare` (``pulling manifest``): the manifest (or Hugging Face's file list), the
   name and every digest and size validated, the disk space checked. A name the registry does
   not know is a 404, a bad name a 400, no room a 507, a registry that cannot be reached a 502.
2. :meth:`Puller.run`: an async iterator of progress in Ollama's shape (``pulling <12 hex>`` with
   ``digest``/``total``/``completed``, then ``verifying sha256 digest``, ``writing manifest``,
   ``success``). Layers are fetched one after the other, as Ollama does.

How a blob is kept (never half-written, never visible unverified):

* it is downloaded into ``blobs/sha256-<hex>-partial``; its sha256 is checked when it is complete,
  then it is renamed to ``blobs/sha256-<hex>``. A wrong digest removes the partial file;
* never more bytes than the manifest's size are written (a longer answer is an error);
* a cut connection is retried from where it stopped (``Range: bytes=N-``; a server answering
  200 instead of 206 starts it over), up to ``retries`` times, and a later pull resumes the
  partial file the same way;
* concurrent pulls of the same blob share one download (the others follow its progress; if its
  owner is cancelled, a follower takes over from the partial file);
* the manifest is written last, atomically (temporary file, fsync, rename): the model appears in
  ``/api/tags`` only when every layer is in place.

Environment (read on each pull):

* ``TRIOSHED_OLLAMA_REGISTRY`` (default ``https://registry.ollama.ai``): the base URL used for
  names on Ollama's registry; another host in a name is ``https://HOST`` (``http://`` with
  ``insecure``);
* ``TRIOSHED_HF_ENDPOINT``, else ``HF_ENDPOINT`` (default ``https://huggingface.co``): Hugging
  Face's base URL;
* ``HF_TOKEN`` (else ``HUGGING_FACE_HUB_TOKEN``): sent as a bearer token to Hugging Face;
* ``TRIOSHED_REGISTRY_TOKEN``: sent as a bearer token to a registry's token service when the
  registry asks for one (``WWW-Authenticate: Bearer realm=…``; the Docker token flow). Ollama's
  own key-signed tokens (for private models on ollama.com) are not supported;
* ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY`` and ``SSL_CERT_FILE`` as httpx reads
  them (``trust_env``).

``insecure`` (as in Ollama's request) skips TLS certificate checks and lets a name's own registry
host be reached over plain HTTP.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from trioshed import __version__
from trioshed.errors import Forbidden, InsufficientStorage, RegistryError, TrioshedError
from trioshed.models import ollama_store as o
from trioshed.models.pull_plan import (
    HF_HOST,
    MANIFEST_V2,
    MAX_MANIFEST,
    Layer,
    Plan,
    Target,
    bytes_to_fetch,
    check_digest,
    choose_hf_files,
    content_range_start,
    hf_plan,
    manifest_path_parts,
    not_found,
    parse_challenge,
    parse_hf_tree,
    parse_manifest,
    parse_target,
    progress,
)

log = logging.getLogger(__name__)

DEFAULT_OLLAMA_REGISTRY = "https://registry.ollama.ai"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
PULLED = "pulled"  # the pull store's folder inside the first folder store
CHUNK = 1 << 20  # bytes read and written at a time (and the progress granularity)
DISK_MARGIN = 64 << 20  # room left free after a pull's downloads, for manifests and the system
MAX_HF_PAGES = 20  # pages of Hugging Face's file list followed (Link: rel="next")


@dataclass(frozen=True)
class Registries:
    """Where names are pulled from, and the credentials sent there (see the module docstring)."""

    ollama: str = DEFAULT_OLLAMA_REGISTRY
    hf: str = DEFAULT_HF_ENDPOINT
    hf_token: str | None = field(default=None, repr=False)
    registry_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Registries:
        env = os.environ if env is None else env
        return cls(
            ollama=(env.get("TRIOSHED_OLLAMA_REGISTRY") or DEFAULT_OLLAMA_REGISTRY).rstrip("/"),
            hf=(env.get("TRIOSHED_HF_ENDPOINT") or env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/"),
            hf_token=env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None,
            registry_token=env.get("TRIOSHED_REGISTRY_TOKEN") or None,
        )


def _free_space(path: Path) -> int:
    return shutil.disk_usage(path).free


@dataclass
class _Session:
    """One pull's connection settings: the registry's base URL and the token it granted."""

    target: Target
    base: str
    insecure: bool
    authorization: str | None = None  # "Bearer ..." once a token is known (HF: HF_TOKEN at once)

    def blob_url(self, layer: Layer) -> str:
        return layer.url or f"{self.base}/v2/{self.target.repository}/blobs/{layer.digest}"


@dataclass(frozen=True)
class Prepared:
    """A pull whose manifest is known and checked: :meth:`Puller.run` fetches and writes it."""

    plan: Plan
    session: _Session


class _Download:
    """One blob being downloaded, followed by every pull that needs it."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self.completed = 0
        self.done = trio.Event()
        self.error: BaseException | None = None
        self._changed = trio.Event()

    def advance(self, completed: int) -> None:
        self.completed = completed
        self._changed.set()
        self._changed = trio.Event()

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()
        self._changed.set()

    async def wait_changed(self) -> None:
        await self._changed.wait()


class Puller:
    """Pulls into the Ollama-layout store at ``root`` (``<store>/pulled``); one per server.

    ``free_space`` (bytes free where blobs go) and ``retries``/``backoff`` are injectable for
    tests; ``transport`` too (an httpx transport instead of the network).
    """

    def __init__(
        self,
        root: Path | None,
        *,
        registries: Registries | None = None,
        free_space: Callable[[Path], int] = _free_space,
        retries: int = 5,
        backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else None
        self._registries = registries
        self._free_space = free_space
        self._retries = retries
        self._backoff = backoff
        self._transport = transport
        self._downloads: dict[str, _Download] = {}

    @property
    def registries(self) -> Registries:
        return self._registries if self._registries is not None else Registries.from_env()

    def statistics(self) -> dict[str, int]:
        """Downloads in flight, by digest: bytes completed so far."""
        return {digest: d.completed for digest, d in self._downloads.items()}

    def _store(self) -> Path:
        if self.root is None:
            raise Forbidden(
                "pull needs a folder store to write into (its pulled/ folder); every folder in "
                "TRIOSHED_MODELS is a read-only Ollama store: add a folder, e.g. "
                "TRIOSHED_MODELS=~/.trioshed/models:~/.ollama/models, or use 'ollama pull'"
            )
        return self.root

    @asynccontextmanager
    async def _client(self, insecure: bool) -> AsyncIterator[httpx.AsyncClient]:
        kwargs: dict[str, Any] = {"transport": self._transport} if self._transport is not None else {}
        async with httpx.AsyncClient(
            trust_env=True,
            verify=not insecure,
            follow_redirects=True,
            timeout=httpx.Timeout(30.0, read=60.0),
            headers={"User-Agent": f"trioshed/{__version__}"},
            **kwargs,
        ) as client:
            yield client

    # -- step 1: the manifest ----------------------------------------------------------------

    async def prepare(self, name: object, *, insecure: bool = False) -> Prepared:
        """Fetch and check what ``name`` is; raise its HTTP status (400/403/404/502/507) now."""
        target = parse_target(name)
        manifest_path_parts(target.name)
        store = self._store()
        registries = self.registries
        if target.source == "hf":
            session = _Session(target, registries.hf, insecure, f"Bearer {registries.hf_token}" if registries.hf_token else None)
        else:
            host = target.name.host
            base = registries.ollama if host.lower() == o.DEFAULT_HOST else f"{'http' if insecure else 'https'}://{host}"
            session = _Session(target, base, insecure)
        async with self._client(insecure) as client:
            plan = await (self._hf_plan if target.source == "hf" else self._ollama_plan)(client, session)
        await trio.to_thread.run_sync(self._check_space, store, plan)
        return Prepared(plan, session)

    async def _ollama_plan(self, client: httpx.AsyncClient, session: _Session) -> Plan:
        target = session.target
        url = f"{session.base}/v2/{target.repository}/manifests/{target.name.tag}"
        async with self._get(client, session, url, accept=MANIFEST_V2) as response:
            if response.status_code == 404:
                raise not_found(target, f"pull model manifest: file does not exist (not in {session.base})")
            self._check_status(response, f"the manifest of '{target.display}'")
            raw = await _read_bounded(response, MAX_MANIFEST)
        return parse_manifest(target, raw)

    async def _hf_plan(self, client: httpx.AsyncClient, session: _Session) -> Plan:
        target = session.target
        url: str | None = f"{session.base}/api/models/{target.repository}/tree/main?recursive=true"
        items: list[Any] = []
        for _ in range(MAX_HF_PAGES):
            if url is None:
                break
            async with self._get(client, session, url, accept="application/json") as response:
                if response.status_code in (401, 404) and session.authorization is None and not items:
                    # Hugging Face answers 401 for a repository that does not exist (or is private)
                    raise not_found(target, f"hf.co/{target.repository} does not exist (or is private or gated: set HF_TOKEN)")
                if response.status_code == 404:
                    raise not_found(target, f"hf.co/{target.repository} does not exist")
                self._check_status(response, f"the file list of hf.co/{target.repository}")
                try:
                    page = json.loads(await _read_bounded(response, 16 << 20))
                except ValueError:
                    raise RegistryError(f"Hugging Face's file list of hf.co/{target.repository} is not JSON; nothing was kept") from None
                items.extend(page if isinstance(page, list) else [page])
                url = response.links.get("next", {}).get("url")
        choice = choose_hf_files(target, parse_hf_tree(items))

        def resolve(path: str) -> str:
            return f"{session.base}/{target.repository}/resolve/main/{path}"

        return hf_plan(target, choice, model_url=resolve(choice.model.path),
                       projector_url=resolve(choice.projector.path) if choice.projector else "")  # fmt: skip

    def _check_space(self, store: Path, plan: Plan) -> None:
        """507 when the blobs still to download do not fit (with :data:`DISK_MARGIN` to spare)."""
        blobs = store / "blobs"
        present: dict[str, int] = {}
        for layer in plan.layers:
            for suffix in ("", "-partial"):
                try:
                    present[layer.digest] = max(present.get(layer.digest, 0), (blobs / f"sha256-{layer.hex}{suffix}").stat().st_size)
                except OSError:
                    continue
                if not suffix:
                    present[layer.digest] = layer.size
        needed = bytes_to_fetch(plan, present)
        if needed == 0:
            return
        where = blobs if blobs.is_dir() else store if store.is_dir() else store.parent
        while not where.exists():
            where = where.parent
        free = self._free_space(where)
        if needed + DISK_MARGIN > free:
            raise InsufficientStorage(needed + DISK_MARGIN, free, str(store))

    # -- HTTP --------------------------------------------------------------------------------

    @asynccontextmanager
    async def _get(
        self, client: httpx.AsyncClient, session: _Session, url: str, *, accept: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[httpx.Response]:  # fmt: skip
        """GET ``url`` streamed; a 401 with a bearer challenge fetches a token and asks again once.
        Network failures are a :class:`RegistryError` naming the URL."""
        request_headers = dict(headers or {})
        if accept:
            request_headers["Accept"] = accept
        for attempt in range(2):
            if session.authorization:
                request_headers["Authorization"] = session.authorization
            try:
                response = await client.send(client.build_request("GET", url, headers=request_headers), stream=True)
            except httpx.HTTPError as exc:
                raise RegistryError(f"cannot reach {_origin(url)}: {exc or type(exc).__name__}; check the network, "
                                    "the proxy (HTTPS_PROXY) or the registry's URL") from None  # fmt: skip
            try:
                challenge = response.headers.get("www-authenticate", "")
                if response.status_code == 401 and attempt == 0 and challenge.lower().startswith("bearer") and session.target.source != "hf":
                    await response.aread()
                    await self._authorize(client, session, challenge)
                    continue
                yield response
                return
            finally:
                await response.aclose()

    async def _authorize(self, client: httpx.AsyncClient, session: _Session, challenge: str) -> None:
        """The Docker token flow: ``GET realm?service=…&scope=…`` → ``{"token": …}``."""
        _, params = parse_challenge(challenge)
        realm = params.get("realm", "")
        if not realm.startswith(("https://", "http://")):
            raise RegistryError(f"{session.base} asks for a token without a usable realm; nothing was kept")
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        token = self.registries.registry_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            response = await client.get(realm, params=query, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryError(f"cannot reach the token service {_origin(realm)}: {exc}") from None
        if response.status_code != 200:
            raise RegistryError(
                f"the registry's token service refused access (HTTP {response.status_code}); "
                "set TRIOSHED_REGISTRY_TOKEN if the model needs credentials"
            )
        try:
            data = response.json()
        except ValueError:
            data = None
        granted = (data.get("token") or data.get("access_token")) if isinstance(data, dict) else None
        if not isinstance(granted, str) or not granted:
            raise RegistryError("the registry's token service answered without a token")
        session.authorization = f"Bearer {granted}"

    def _check_status(self, response: httpx.Response, what: str) -> None:
        if response.status_code == 200:
            return
        if response.status_code in (401, 403):
            hint = "set HF_TOKEN" if "hf" in what or HF_HOST in what else "set TRIOSHED_REGISTRY_TOKEN"
            raise RegistryError(f"the registry refused {what} (HTTP {response.status_code}); {hint} if it needs credentials")
        raise RegistryError(f"the registry answered HTTP {response.status_code} for {what}; nothing was kept")

    # -- step 2: the blobs and the manifest --------------------------------------------------

    async def run(self, prepared: Prepared) -> AsyncIterator[dict[str, Any]]:
        """Progress lines, in Ollama's shape, while the layers are fetched and the manifest
        written. An error is raised (a :class:`TrioshedError`); what was verified stays, a
        partial download stays for the next pull to resume, the manifest is not written.

        Cancellation: the pull stops where it is; a blob it was downloading stays partial (a
        pull following that download takes it over)."""
        plan, session = prepared.plan, prepared.session
        store = self._store()
        blobs = store / "blobs"
        try:
            await trio.to_thread.run_sync(lambda: blobs.mkdir(parents=True, exist_ok=True))
            yield progress("pulling manifest")
            async with self._client(session.insecure) as client:
                for layer in plan.layers:
                    async for line in self._fetch(client, session, blobs, layer):
                        yield line
            yield progress("verifying sha256 digest")
            for layer in plan.layers:  # each was verified when it completed; check it is still whole
                path = blobs / f"sha256-{layer.hex}"
                size = await trio.to_thread.run_sync(lambda p=path: p.stat().st_size if p.is_file() else -1)  # type: ignore[misc]
                if size != layer.size:
                    raise RegistryError(f"blob {layer.short} changed while pulling ({size} bytes, {layer.size} expected); pull again")
            yield progress("writing manifest")
            await trio.to_thread.run_sync(self._write_manifest, store, plan)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise InsufficientStorage(plan.total, self._free_space(store if store.exists() else store.parent), str(store)) from None
            raise TrioshedError(f"cannot write the pulled model into {store}: {exc}; check the folder's permissions") from None
        yield progress("success")

    async def pull(self, name: object, *, insecure: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Both steps: what ``trioshed pull`` without a server, and tests, use."""
        prepared = await self.prepare(name, insecure=insecure)
        async for line in self.run(prepared):
            yield line

    def _write_manifest(self, store: Path, plan: Plan) -> None:
        path = store.joinpath("manifests", *manifest_path_parts(plan.target.name))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{id(plan)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(plan.manifest)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def _fetch(self, client: httpx.AsyncClient, session: _Session, blobs: Path, layer: Layer) -> AsyncIterator[dict[str, Any]]:
        status = f"pulling {layer.short}"
        check_digest(layer.digest)
        final = blobs / f"sha256-{layer.hex}"
        while True:
            if await trio.to_thread.run_sync(final.is_file):
                yield progress(status, layer)
                return
            download = self._downloads.get(layer.digest)
            if download is None:
                download = self._downloads[layer.digest] = _Download(layer)
                error: BaseException | None = None
                try:
                    async for completed in self._download(client, session, blobs, layer, download):
                        yield progress(status, layer, completed)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    del self._downloads[layer.digest]
                    download.finish(error)
                continue  # the blob is in place now: its last line says so
            # another pull downloads it: follow its progress
            while not download.done.is_set():
                yield progress(status, layer, download.completed)
                await download.wait_changed()
            if isinstance(download.error, TrioshedError):
                raise _copy_error(download.error)
            # finished, or its owner was cancelled (then this pull takes over from the partial file)

    async def _download(
        self, client: httpx.AsyncClient, session: _Session, blobs: Path, layer: Layer, download: _Download
    ) -> AsyncIterator[int]:
        """Bytes completed, as they arrive; then verify and rename. A layer made here (``data``)
        is written at once."""
        partial = blobs / f"sha256-{layer.hex}-partial"
        final = blobs / f"sha256-{layer.hex}"
        if layer.data is not None:
            await trio.to_thread.run_sync(partial.write_bytes, layer.data)
        have = await trio.to_thread.run_sync(lambda: partial.stat().st_size if partial.exists() else 0)
        if have > layer.size:
            have = 0
            await trio.to_thread.run_sync(partial.unlink)
        download.advance(have)
        yield have
        failures = 0
        url = session.blob_url(layer)
        while have < layer.size:
            try:
                async for got in self._receive(client, session, url, partial, layer, have):
                    have = got
                    download.advance(have)
                    yield have
            except _Interrupted as exc:
                have = exc.have
                failures += 1
                if failures > self._retries:
                    raise RegistryError(
                        f"the download of {layer.short} was interrupted {failures} times ({exc.cause}); "
                        f"{have} of {layer.size} bytes are kept: pull again to resume"
                    ) from None
                log.info("pull: %s interrupted at %d/%d bytes (%s); resuming", layer.short, have, layer.size, exc.cause)
                await trio.sleep(self._backoff * failures)
        ok = await trio.to_thread.run_sync(_verify, partial, final, layer)
        if not ok:
            raise RegistryError(
                f"digest mismatch for {layer.short}: the downloaded bytes do not have the sha256 the "
                "manifest names; the file was removed and nothing was kept (pull again; if it persists "
                "the registry or a proxy alters the file)"
            )

    async def _receive(
        self, client: httpx.AsyncClient, session: _Session, url: str, partial: Path, layer: Layer, have: int
    ) -> AsyncIterator[int]:
        """One GET of the rest of the blob (``Range`` from ``have``), appended to the partial file."""
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            async with self._get(client, session, url, headers=headers) as response:
                if response.status_code == 206 and content_range_start(response.headers.get("content-range"), layer.size) == have:
                    mode = "ab"
                elif response.status_code == 200:
                    have, mode = 0, "wb"  # no range support: start over
                elif response.status_code == 404:
                    raise RegistryError(f"the registry has no blob {layer.digest} although the manifest names it; nothing was kept")
                else:
                    self._check_status(response, f"blob {layer.short}")
                    raise AssertionError("unreachable")  # pragma: no cover
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and have + int(length) != layer.size:
                    raise RegistryError(
                        f"the registry sends {have + int(length)} bytes for blob {layer.short}, the manifest says "
                        f"{layer.size}; nothing was kept"
                    )
                f = await trio.to_thread.run_sync(open, partial, mode)
                pending = bytearray()  # received, not yet written: written whatever happens next
                try:
                    async for chunk in response.aiter_raw():
                        if have + len(pending) + len(chunk) > layer.size:
                            raise RegistryError(f"the registry sent more than the {layer.size} bytes of blob {layer.short}; nothing was kept")
                        pending += chunk
                        if len(pending) >= CHUNK:
                            await trio.to_thread.run_sync(f.write, pending)
                            have += len(pending)
                            pending.clear()
                            yield have
                finally:
                    with trio.CancelScope(shield=True):
                        try:
                            if pending:  # what arrived before a cut is kept for the resume
                                await trio.to_thread.run_sync(f.write, pending)
                                have += len(pending)
                        finally:
                            await trio.to_thread.run_sync(f.close)
                if pending:
                    yield have
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                free = await trio.to_thread.run_sync(self._free_space, partial.parent)
                raise InsufficientStorage(layer.size - have, free, str(partial.parent.parent)) from None
            raise TrioshedError(f"cannot write {partial}: {exc}; check the folder's permissions") from None
        except httpx.HTTPError as exc:  # the connection broke mid-body
            raise _Interrupted(have, f"{type(exc).__name__}: {exc}") from None
        if have < layer.size:
            raise _Interrupted(have, "the connection closed early")


class _Interrupted(Exception):
    def __init__(self, have: int, cause: str) -> None:
        super().__init__(cause)
        self.have = have
        self.cause = cause


def _copy_error(error: TrioshedError) -> TrioshedError:
    """The error of a download this pull followed, as its own exception object (the same class,
    status and message: one exception object is never raised in two tasks)."""
    copy = TrioshedError.__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    return copy


def _verify(partial: Path, final: Path, layer: Layer) -> bool:
    """Hash the complete partial file; on a match rename it into place, else remove it."""
    h = hashlib.sha256()
    with open(partial, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    if h.hexdigest() != layer.hex:
        partial.unlink(missing_ok=True)
        return False
    os.replace(partial, final)
    return True


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            raise RegistryError(f"{_origin(str(response.url))} sent more than {limit} bytes where a small document was expected")
    return bytes(data)


def _origin(url: str) -> str:
    try:
        parsed = httpx.URL(url)
        return f"{parsed.scheme}://{parsed.netloc.decode()}"
    except Exception:  # only for a message
        return url[:80]


def pull_store(first_folder_store: Path | None) -> Path | None:
    """Where pulled models go: ``<folder store>/pulled``."""
    return None if first_folder_store is None else first_folder_store / PULLED

