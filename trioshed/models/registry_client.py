"""The registry side of a pull: HTTP to an Ollama registry and to Hugging Face (httpx under trio).

* :func:`fetch_plan`: the manifest (``GET /v2/<ns>/<model>/manifests/<tag>``, Accept: the Docker
  v2 manifest type), or Hugging Face's file list (``/api/models/USER/REPO/tree/main``, pages
  followed through ``Link: rel="next"``) and the GGUF chosen for the quant
  (:func:`~trioshed.models.pull_plan.choose_hf_files`);
* :func:`open_get`: a streamed GET; a 401 with ``WWW-Authenticate: Bearer realm=…`` runs the
  Docker token flow once (``TRIOSHED_REGISTRY_TOKEN`` is sent to the token service). Redirects
  are followed (the registry's to its CDN, Hugging Face's ``resolve``); httpx drops the
  ``Authorization`` header when a redirect leaves the origin.

Every network failure is a :class:`~trioshed.errors.RegistryError` (502) naming the origin; a
name the registry does not know is a 404 (:func:`~trioshed.models.pull_plan.not_found`).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from trioshed import __version__
from trioshed.errors import RegistryError
from trioshed.models import ollama_store as o
from trioshed.models.pull_plan import (
    HF_HOST,
    MANIFEST_V2,
    MAX_MANIFEST,
    Layer,
    Plan,
    Target,
    choose_hf_files,
    hf_plan,
    not_found,
    parse_challenge,
    parse_hf_tree,
    parse_manifest,
)

DEFAULT_OLLAMA_REGISTRY = "https://registry.ollama.ai"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
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


@dataclass
class Session:
    """One pull's connection settings: the registry's base URL and the token it granted."""

    target: Target
    base: str
    insecure: bool
    authorization: str | None = field(default=None, repr=False)  # "Bearer ..." once known (HF: HF_TOKEN at once)
    registry_token: str | None = field(default=None, repr=False)  # sent to a token service

    def blob_url(self, layer: Layer) -> str:
        return layer.url or f"{self.base}/v2/{self.target.repository}/blobs/{layer.digest}"


@asynccontextmanager
async def open_client(insecure: bool) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        trust_env=True,
        verify=not insecure,
        follow_redirects=True,
        timeout=httpx.Timeout(30.0, read=60.0),
        headers={"User-Agent": f"trioshed/{__version__}"},
    ) as client:
        yield client



async def fetch_plan(client: httpx.AsyncClient, session: Session) -> Plan:
    """The plan of ``session.target``: its manifest (Ollama's registry) or its chosen files (Hugging Face)."""
    return await (_hf_plan if session.target.source == "hf" else _ollama_plan)(client, session)


async def _ollama_plan(client: httpx.AsyncClient, session: Session) -> Plan:
    target = session.target
    url = f"{session.base}/v2/{target.repository}/manifests/{target.name.tag}"
    async with open_get(client, session, url, accept=MANIFEST_V2) as response:
        if response.status_code == 404:
            raise not_found(target, f"pull model manifest: file does not exist (not in {session.base})")
        check_status(response, f"the manifest of '{target.display}'")
        raw = await read_bounded(response, MAX_MANIFEST)
    return parse_manifest(target, raw)

async def _hf_plan(client: httpx.AsyncClient, session: Session) -> Plan:
    target = session.target
    url: str | None = f"{session.base}/api/models/{target.repository}/tree/main?recursive=true"
    items: list[Any] = []
    for _ in range(MAX_HF_PAGES):
        if url is None:
            break
        async with open_get(client, session, url, accept="application/json") as response:
            if response.status_code in (401, 404) and session.authorization is None and not items:
                # Hugging Face answers 401 for a repository that does not exist (or is private)
                raise not_found(target, f"hf.co/{target.repository} does not exist (or is private or gated: set HF_TOKEN)")
            if response.status_code == 404:
                raise not_found(target, f"hf.co/{target.repository} does not exist")
            check_status(response, f"the file list of hf.co/{target.repository}")
            try:
                page = json.loads(await read_bounded(response, 16 << 20))
            except ValueError:
                raise RegistryError(f"Hugging Face's file list of hf.co/{target.repository} is not JSON; nothing was kept") from None
            items.extend(page if isinstance(page, list) else [page])
            url = response.links.get("next", {}).get("url")
    choice = choose_hf_files(target, parse_hf_tree(items))

    def resolve(path: str) -> str:
        return f"{session.base}/{target.repository}/resolve/main/{path}"

    return hf_plan(target, choice, model_url=resolve(choice.model.path),
                   projector_url=resolve(choice.projector.path) if choice.projector else "")  # fmt: skip


@asynccontextmanager
async def open_get(
    client: httpx.AsyncClient, session: Session, url: str, *, accept: str | None = None,
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
            raise RegistryError(f"cannot reach {origin(url)}: {exc or type(exc).__name__}; check the network, "
                                "the proxy (HTTPS_PROXY) or the registry's URL") from None  # fmt: skip
        try:
            challenge = response.headers.get("www-authenticate", "")
            if response.status_code == 401 and attempt == 0 and challenge.lower().startswith("bearer") and session.target.source != "hf":
                await response.aread()
                await _authorize(client, session, challenge)
                continue
            yield response
            return
        finally:
            await response.aclose()

async def _authorize(client: httpx.AsyncClient, session: Session, challenge: str) -> None:
    """The Docker token flow: ``GET realm?service=…&scope=…`` → ``{"token": …}``."""
    _, params = parse_challenge(challenge)
    realm = params.get("realm", "")
    if not realm.startswith(("https://", "http://")):
        raise RegistryError(f"{session.base} asks for a token without a usable realm; nothing was kept")
    query = {k: v for k, v in params.items() if k in ("service", "scope")}
    token = session.registry_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = await client.get(realm, params=query, headers=headers)
    except httpx.HTTPError as exc:
        raise RegistryError(f"cannot reach the token service {origin(realm)}: {exc}") from None
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

def check_status(response: httpx.Response, what: str) -> None:
    if response.status_code == 200:
        return
    if response.status_code in (401, 403):
        hint = "set HF_TOKEN" if "hf" in what or HF_HOST in what else "set TRIOSHED_REGISTRY_TOKEN"
        raise RegistryError(f"the registry refused {what} (HTTP {response.status_code}); {hint} if it needs credentials")
    raise RegistryError(f"the registry answered HTTP {response.status_code} for {what}; nothing was kept")

async def read_bounded(response: httpx.Response, limit: int) -> bytes:
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            raise RegistryError(f"{origin(str(response.url))} sent more than {limit} bytes where a small document was expected")
    return bytes(data)


def origin(url: str) -> str:
    try:
        parsed = httpx.URL(url)
        return f"{parsed.scheme}://{parsed.netloc.decode()}"
    except Exception:  # only for a message
        return url[:80]


def session_for(target: Target, registries: Registries, *, insecure: bool) -> Session:
    """Where ``target`` is fetched from: Hugging Face, the configured Ollama registry for its
    default host, else ``https://HOST`` (``http://`` with ``insecure``)."""
    if target.source == "hf":
        token = f"Bearer {registries.hf_token}" if registries.hf_token else None
        return Session(target, registries.hf, insecure, authorization=token)
    host = target.name.host
    base = registries.ollama if host.lower() == o.DEFAULT_HOST else f"{'http' if insecure else 'https'}://{host}"
    return Session(target, base, insecure, registry_token=registries.registry_token)


async def send(
    client: httpx.AsyncClient, session: Session, method: str, url: str, *,
    content: bytes | AsyncIterator[bytes] | None = None, headers: Mapping[str, str] | None = None,
) -> httpx.Response:  # fmt: skip
    """One request (its answer read whole); a 401 with a bearer challenge runs the token flow
    and asks once more (a streamed body is not sent twice: the caller asks something small of the
    same scope first). Network failures are a :class:`RegistryError` naming the origin."""
    request_headers = dict(headers or {})
    for attempt in range(2):
        if session.authorization:
            request_headers["Authorization"] = session.authorization
        try:
            response = await client.request(method, url, content=content, headers=request_headers)
        except httpx.HTTPError as exc:
            raise RegistryError(f"cannot reach {origin(url)}: {exc or type(exc).__name__}; check the network, "
                                "the proxy (HTTPS_PROXY) or the registry's URL") from None  # fmt: skip
        challenge = response.headers.get("www-authenticate", "")
        if response.status_code == 401 and attempt == 0 and challenge.lower().startswith("bearer") and isinstance(content, bytes | None):
            await _authorize(client, session, challenge)
            continue
        return response
    raise AssertionError("unreachable")  # pragma: no cover
