"""Who may drive trioshed: the Origin and Host checks and the API key (pure, no I/O).

A web page the user visits can send requests to ``http://127.0.0.1:11434``. Three checks stop
it from driving trioshed, each as Ollama does:

* **Origin** (:func:`origin_allowed`). A request whose ``Origin`` header is present and not
  allowed is refused with 403 before anything else happens (also "simple" requests, which a
  browser sends without a preflight and whose answer it merely hides from the page). Allowed:
  ``http(s)://localhost``, ``127.0.0.1`` and ``0.0.0.0`` on any port, the desktop/webview
  schemes ``app://``, ``file://``, ``tauri://``, ``vscode-webview://``, ``vscode-file://``,
  and whatever ``TRIOSHED_ORIGINS`` adds (``*`` alone allows every origin; one ``*`` inside a
  pattern matches as Ollama's gin-contrib/cors does: ``https://*.example.com``,
  ``http://host:*`` for any port). Matching is exact on scheme, host and port:
  ``http://localhost.evil.example`` is not ``http://localhost``. A request whose Origin is its
  own ``Host`` is same-origin, not cross-origin, and passes.
* **Host** (:func:`host_allowed`), against DNS rebinding (Ollama's CVE-2024-28224 fix): a page
  on ``evil.example`` whose name is re-pointed at 127.0.0.1 sends requests that are
  same-origin to the browser but carry ``Host: evil.example``. When trioshed listens on a
  loopback address only ``localhost``, ``*.localhost``, IP literals and the machine's own
  hostname are accepted. Listening on another address, names are not checked: the API key is
  what guards it (``serve`` says so at start-up).
* **API key** (:func:`key_matches`): ``Authorization: Bearer <key>`` (OpenAI and Ollama
  clients) or ``x-api-key: <key>`` (Anthropic clients), compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

#: Ollama's default origins (envconfig.AllowedOrigins), matched with its wildcard rules.
DEFAULT_ORIGINS: tuple[str, ...] = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)  # fmt: skip


def allowed_origins(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """``TRIOSHED_ORIGINS`` (lower-cased, trailing ``/`` dropped) followed by the defaults."""
    return tuple(o.strip().lower().rstrip("/") for o in extra if o.strip()) + DEFAULT_ORIGINS


def _wildcard_match(origin: str, pattern: str) -> bool:
    prefix, star, suffix = pattern.partition("*")
    if not star:
        return origin == pattern
    if len(origin) < len(prefix) + len(suffix) or not (origin.startswith(prefix) and origin.endswith(suffix)):
        return False
    middle = origin[len(prefix) : len(origin) - len(suffix)]
    if prefix.endswith(":") and not suffix and "://" in prefix[:-1]:
        return middle.isdigit()  # "http://localhost:*": a port, nothing else
    if "://" in prefix:
        # inside the host: never a path, user info or another port ("file://*" also matches "file://")
        return (bool(middle) or prefix.endswith("://")) and not any(c in middle for c in "/@?#") and (
            ":" not in middle or not suffix
        )
    return not any(c in middle.split("://", 1)[-1] for c in "/@?#")  # "*.example.com": the scheme may vary


def origin_allowed(origin: str, patterns: Iterable[str]) -> bool:
    """Whether a browser's ``Origin`` header is one of ``patterns`` (see the module docstring)."""
    origin = origin.strip().lower()
    for pattern in patterns:
        if pattern == "*" or _wildcard_match(origin, pattern):
            return True
    return False


def same_origin(origin: str, host: str) -> bool:
    """Whether ``Origin`` names the server it is sent to (not a cross-origin request)."""
    origin, host = origin.strip().lower(), host.strip().lower()
    return bool(host) and origin in (f"http://{host}", f"https://{host}")


def _host_name(host: str) -> str:
    """The name in a ``Host`` header: without the port, brackets or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(host: str | None, hostname: str) -> bool:
    """Whether a request to a loopback listener names it by a name no other site can own.

    ``hostname`` is the machine's own name (``socket.gethostname()``). A request without a
    ``Host`` header (HTTP/1.0) is allowed, as Ollama does.
    """
    if not host:
        return True
    name = _host_name(host)
    if name in ("localhost", hostname.lower().rstrip(".")) or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True  # an IP literal: no name to re-point, so no rebinding


def key_matches(authorization: str | None, x_api_key: str | None, key: str) -> bool:
    """Whether a request's ``Authorization`` (``Bearer <key>``) or ``x-api-key`` header is ``key``.

    Both comparisons always run, in constant time: the answer must not tell how much of a guess
    was right, nor which header was checked.
    """
    expected = key.encode()
    bearer = hmac.compare_digest((authorization or "").encode(), b"Bearer " + expected)
    header = hmac.compare_digest((x_api_key or "").encode(), expected)
    return bearer or header


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: a listen address reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: What a key with ``role = "user"`` may call: (method, path pattern; ``*`` = any rest of the
#: path). Every other route, and every route added later unless it is listed here, needs an
#: admin key: pull, push, create, copy, delete, blobs, pin, /metrics, /upstream, unloading.
USER_ROUTES: tuple[tuple[str, str], ...] = (
    # reading: what the server is and which of the key's models it has (lists are filtered)
    ("GET", "/"), ("GET", "/api/version"), ("GET", "/api/tags"), ("GET", "/api/ps"),
    ("GET", "/v1/models"), ("GET", "/v1/models/*"), ("GET", "/openapi.json"),
    ("GET", "/api/events"),  # the status page's stream: the key's models, no log tail
    ("GET", "/api/usage"),  # the key's own usage (everyone's: admin)
    # using models
    ("POST", "/api/generate"), ("POST", "/api/chat"), ("POST", "/api/show"),
    ("POST", "/api/embed"), ("POST", "/api/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/api/rerank"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/rerank"), ("POST", "/v1/reranking"),
    ("POST", "/v1/tokenize"), ("POST", "/v1/detokenize"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/infill"), ("POST", "/apply-template"),
)  # fmt: skip

#: User routes that spend tokens: a key over its token budget is refused there (429).
SPENDING_ROUTES = frozenset(
    p for m, p in USER_ROUTES
    if m == "POST" and p not in ("/api/show", "/v1/messages/count_tokens", "/apply-template") and "tokenize" not in p
)  # fmt: skip


#: Routes a request may be forwarded on from another node of a fleet (every route whose model may
#: be served elsewhere: the user routes that use a model, and ``/upstream``): the only routes
#: where node-to-node headers are honoured (trioshed.fleet.auth).
FORWARDED_ROUTES = frozenset(p for m, p in USER_ROUTES if m == "POST" and p != "/api/show")


def forwarded_route(method: str, path: str) -> bool:
    """Whether a request for ``method path`` is ever forwarded from another node."""
    if path.startswith("/upstream/"):
        return method in ("GET", "POST")
    return method == "POST" and path in FORWARDED_ROUTES


def spends_tokens(path: str) -> bool:
    """Whether a request to ``path`` may spend tokens (a key over a token budget is refused there)."""
    return path in SPENDING_ROUTES or path.startswith("/upstream/")


def route_role(method: str, path: str) -> str:
    """``"user"`` when a user key may call ``method path`` (``HEAD`` as ``GET``), else ``"admin"``."""
    method = "GET" if method == "HEAD" else method
    for m, pattern in USER_ROUTES:
        if m != method:
            continue
        if pattern.endswith("/*"):
            if path.startswith(pattern[:-1]) and len(path) > len(pattern) - 1:
                return "user"
        elif path == pattern:
            return "user"
    return "admin"
