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

The decisions are :mod:`trioshed.models.pull_plan` (pure); the HTTP side (manifests, Hugging
Face's file list, the token flow) is :mod:`trioshed.models.registry_client`; this module owns the
downloads and what is written.

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
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from trioshed.errors import Forbidden, InsufficientStorage, RegistryError, TrioshedError
from trioshed.models.blobs import verify_into_place, write_manifest
from trioshed.models.pull_plan import (
    Layer,
    Plan,
    bytes_to_fetch,
    check_digest,
    content_range_start,
    manifest_path_parts,
    parse_target,
    progress,
)
from trioshed.models.registry_client import (
    Registries,
    Session,
    check_status,
    fetch_plan,
    open_client,
    open_get,
    session_for,
)
from trioshed.models.writer import Report, StoreWriter

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes read and written at a time (and the progress granularity)
DISK_MARGIN = 64 << 20  # room left free after a pull's downloads, for manifests and the system


def _free_space(path: Path) -> int:
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class Prepared:
    """A pull whose manifest is known and checked: :meth:`Puller.run` fetches and writes it."""

    plan: Plan
    session: Session


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
    tests.
    """

    def __init__(
        self,
        root: Path | None,
        *,
        registries: Registries | None = None,
        free_space: Callable[[Path], int] = _free_space,
        retries: int = 5,
        backoff: float = 0.5,
        writer: StoreWriter | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else None
        self.writer = writer or StoreWriter()  # the store's one writer: claims, the manifest's lock
        self._registries = registries
        self._free_space = free_space
        self._retries = retries
        self._backoff = backoff
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

    # -- step 1: the manifest ----------------------------------------------------------------

    async def prepare(self, name: object, *, insecure: bool = False) -> Prepared:
        """Fetch and check what ``name`` is; raise its HTTP status (400/403/404/502/507) now."""
        target = parse_target(name)
        manifest_path_parts(target.name)
        store = self._store()
        session = session_for(target, self.registries, insecure=insecure)
        async with open_client(insecure) as client:
            plan = await fetch_plan(client, session)
        await trio.to_thread.run_sync(self._check_space, store, plan)
        return Prepared(plan, session)

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

    # -- step 2: the blobs and the manifest --------------------------------------------------

    async def run(self, prepared: Prepared, report: Report) -> None:
        """Report progress lines, in Ollama's shape, while the layers are fetched and the
        manifest written. An error is raised (a :class:`TrioshedError`); what was verified stays,
        a partial download stays for the next pull to resume, the manifest is not written. The
        layers are claimed from the store writer for the whole pull (a delete of another model
        sharing one leaves it), the manifest written under its lock.

        Cancellation: the pull stops where it is; a blob it was downloading stays partial (a
        pull following that download takes it over)."""
        plan, session = prepared.plan, prepared.session
        store = self._store()
        blobs = store / "blobs"
        try:
            await trio.to_thread.run_sync(lambda: blobs.mkdir(parents=True, exist_ok=True))
            await report(progress("pulling manifest"))
            async with self.writer.claim(f"sha256-{layer.hex}" for layer in plan.layers):
                async with open_client(session.insecure) as client:
                    for layer in plan.layers:
                        await self._fetch(client, session, blobs, layer, report)
                await report(progress("verifying sha256 digest"))
                for layer in plan.layers:  # each was verified when it completed; check it is still whole
                    path = blobs / f"sha256-{layer.hex}"
                    size = await trio.to_thread.run_sync(lambda p=path: p.stat().st_size if p.is_file() else -1)  # type: ignore[misc]
                    if size != layer.size:
                        raise RegistryError(f"blob {layer.short} changed while pulling ({size} bytes, {layer.size} expected); pull again")
                await report(progress("writing manifest"))
                await self.writer.change(lambda _: self._write_manifest(store, plan))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise InsufficientStorage(plan.total, self._free_space(store if store.exists() else store.parent), str(store)) from None
            raise TrioshedError(f"cannot write the pulled model into {store}: {exc}; check the folder's permissions") from None
        await report(progress("success"))

    async def pull(self, name: object, report: Report, *, insecure: bool = False) -> None:
        """Both steps: what ``trioshed pull`` without a server, and tests, use."""
        prepared = await self.prepare(name, insecure=insecure)
        await self.run(prepared, report)

    def _write_manifest(self, store: Path, plan: Plan) -> None:
        write_manifest(store, manifest_path_parts(plan.target.name), plan.manifest)

    async def _fetch(self, client: httpx.AsyncClient, session: Session, blobs: Path, layer: Layer, report: Report) -> None:
        status = f"pulling {layer.short}"
        check_digest(layer.digest)
        final = blobs / f"sha256-{layer.hex}"
        while True:
            if await trio.to_thread.run_sync(final.is_file):
                await report(progress(status, layer))
                return
            download = self._downloads.get(layer.digest)
            if download is None:
                download = self._downloads[layer.digest] = _Download(layer)
                error: BaseException | None = None
                try:
                    await self._download(client, session, blobs, layer, download, lambda completed: report(progress(status, layer, completed)))
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    del self._downloads[layer.digest]
                    download.finish(error)
                continue  # the blob is in place now: its last line says so
            # another pull downloads it: follow its progress
            while not download.done.is_set():
                await report(progress(status, layer, download.completed))
                await download.wait_changed()
            if isinstance(download.error, TrioshedError):
                raise _copy_error(download.error)
            # finished, or its owner was cancelled (then this pull takes over from the partial file)

    async def _download(
        self, client: httpx.AsyncClient, session: Session, blobs: Path, layer: Layer, download: _Download,
        step: Callable[[int], Awaitable[None]],
    ) -> None:
        """``step`` the bytes completed, as they arrive; then verify and rename. A layer made
        here (``data``) is written at once."""
        partial = blobs / f"sha256-{layer.hex}-partial"
        final = blobs / f"sha256-{layer.hex}"
        if layer.data is not None:
            await trio.to_thread.run_sync(partial.write_bytes, layer.data)
        have = await trio.to_thread.run_sync(lambda: partial.stat().st_size if partial.exists() else 0)
        if have > layer.size:
            have = 0
            await trio.to_thread.run_sync(partial.unlink)
        download.advance(have)
        await step(have)
        failures = 0
        url = session.blob_url(layer)
        while have < layer.size:
            async def received(got: int) -> None:
                download.advance(got)
                await step(got)

            try:
                have = await self._receive(client, session, url, partial, layer, have, received)
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
        self, client: httpx.AsyncClient, session: Session, url: str, partial: Path, layer: Layer, have: int,
        step: Callable[[int], Awaitable[None]],
    ) -> int:
        """One GET of the rest of the blob (``Range`` from ``have``), appended to the partial
        file, ``step`` the bytes completed as they are written; returns them at the end."""
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            async with open_get(client, session, url, headers=headers) as response:
                if response.status_code == 206 and content_range_start(response.headers.get("content-range"), layer.size) == have:
                    mode = "ab"
                elif response.status_code == 200:
                    have, mode = 0, "wb"  # no range support: start over
                elif response.status_code == 404:
                    raise RegistryError(f"the registry has no blob {layer.digest} although the manifest names it; nothing was kept")
                else:
                    check_status(response, f"blob {layer.short}")
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
                            await step(have)
                finally:
                    with trio.CancelScope(shield=True):
                        try:
                            if pending:  # what arrived before a cut is kept for the resume
                                await trio.to_thread.run_sync(f.write, pending)
                                have += len(pending)
                        finally:
                            await trio.to_thread.run_sync(f.close)
                if pending:
                    await step(have)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                free = await trio.to_thread.run_sync(self._free_space, partial.parent)
                raise InsufficientStorage(layer.size - have, free, str(partial.parent.parent)) from None
            raise TrioshedError(f"cannot write {partial}: {exc}; check the folder's permissions") from None
        except httpx.HTTPError as exc:  # the connection broke mid-body
            raise _Interrupted(have, f"{type(exc).__name__}: {exc}") from None
        if have < layer.size:
            raise _Interrupted(have, "the connection closed early")
        return have


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
    return verify_into_place(partial, final, layer.hex)
