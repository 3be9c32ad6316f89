"""Who may use the API: the Origin, the Host (against DNS rebinding), the API key and its rate
(or, for a request another node forwarded, its signature and the serving node's own record of
the key it names: :mod:`trioshed.fleet.auth`), and the body's announced size and type; and the
CORS headers an allowed page gets. One :class:`Gate` per app, asked by the request wrapper
(:mod:`trioshed.api.pipeline.wrapper`) on both serving paths."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from trioshed import access
from trioshed.api.observe import ui
from trioshed.api.pipeline import limits
from trioshed.api.state import AppState
from trioshed.errors import Forbidden, PayloadTooLarge, TooManyRequests, TrioshedError, Unauthorized
from trioshed.fleet.auth import FleetAuth, serve_here
from trioshed.keys import (
    ANONYMOUS,
    PUBLIC,
    ApiKey,
    KeyRing,
    RequestRate,
    current_key,
    digest,
    keyring,
)
from trioshed.trace import current as current_trace

#: What a browser may send cross-origin (the official JS clients' headers included).
_ALLOW_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, x-api-key, anthropic-version"

#: Routes whose body is not bounded by TRIOSHED_MAX_BODY: a blob upload is streamed to disk with
#: its own bound (see trioshed.models.blobs) and may be any type.
_UNREAD_BODIES = ("/api/blobs/",)
#: The fleet's own routes: node-to-node requests only.
_FLEET_ROUTES = "/api/fleet/"


class UnknownKey(Unauthorized):
    """A key this node does not know (yet): the shared store may know it (``credential``: the
    presented secret's digest, or ``name:<key>`` for a forwarded request's key), see
    :meth:`Gate.look_again`."""

    def __init__(self, credential: str, message: str) -> None:
        super().__init__(message)
        self.credential = credential


class Gate:
    """Who may use the API: the Origin, the Host (against DNS rebinding), the API key and its
    rate, and the body's announced size and type. One instance per app, asked by the request
    wrapper (:mod:`trioshed.api.pipeline.wrapper`) for the Quart routes and the fast path alike.

    ``get`` is a header lookup (case-insensitive name -> first value or None).
    """

    def __init__(self, state: AppState) -> None:
        self.origins = access.allowed_origins(state.settings.origins)
        self.check_host = access.is_loopback(state.settings.host)  # else the API key guards (serve says so)
        self.hostname = socket.gethostname()
        self.state = state
        self.keys = keyring(state.settings.api_key, state.settings.keys_file, *self._stored())  # TRIOSHED_API_KEY, TRIOSHED_KEYS_FILE, the store's
        self.rate = RequestRate()
        state.reload_keys = self.reload_keys
        state.keys = self.keys.keys
        self.max_body = state.settings.max_body
        self.metrics_public = state.settings.metrics_public  # TRIOSHED_METRICS_PUBLIC
        self.fleet = state.fleet.auth if state.fleet is not None else FleetAuth(None)  # one nonce memory per node

    def origin_ok(self, origin: str, host: str) -> bool:
        return access.same_origin(origin, host) or access.origin_allowed(origin, self.origins)

    def check_origin(self, get: Callable[[str], str | None]) -> None:
        """Origin and Host first: a request from a page that is not allowed does nothing at all."""
        origin = get("Origin")
        host = get("Host")
        if origin is not None and not self.origin_ok(origin, host or ""):
            raise Forbidden(f"origin {origin[:200]!r} is not allowed; add it to TRIOSHED_ORIGINS to allow it")
        if self.check_host and not access.host_allowed(host, self.hostname):
            raise Forbidden(
                f"host {(host or '')[:200]!r} is not allowed: a server on a loopback address answers only to "
                "localhost, *.localhost, its IP addresses and this machine's name"
            )

    def check_request(
        self,
        method: str,
        path: str,
        get: Callable[[str], str | None],
        content_length: int | None,
        *,
        count: bool = True,
    ) -> ApiKey | None:
        """The key, the body's announced size and type, then the key's rate (the one check that
        counts: last, so a request refused for another reason is not counted). Returns the key.

        ``count=False``: the caller calls :meth:`admit` itself, once the request is known to go
        no other way."""
        public = method in ("GET", "HEAD") and (
            path == "/" or path in ui.PUBLIC or (path == "/metrics" and self.metrics_public)
        )
        key = None
        if path.startswith(_FLEET_ROUTES):
            # a node's own route: a signed node-to-node request, no API key (a first state poll
            # may not know the receiving node's name yet)
            self.fleet.verify(method, path, get, any_receiver=True)
            return None
        if self.fleet.claims(get) and access.forwarded_route(method, path):
            key = self._forwarded(method, path, get)  # the serving node's own record of its key
        elif self.keys.required:
            key = self._identify(get, public)
            if public:
                return None  # a public route: nothing counted (the key, if any, says what it sees)
        if key is not None and not key.admin and access.route_role(method, path) == "admin":
            raise Forbidden(
                f"API key '{key.name}' may not use {method} {path[:200]}: it needs an admin key "
                '(role = "admin" in the keys file)'
            )
        if not path.startswith(_UNREAD_BODIES):
            if content_length is not None and content_length > self.max_body:
                raise PayloadTooLarge(
                    f"request body of {content_length} bytes exceeds the {self.max_body} byte limit (TRIOSHED_MAX_BODY)"
                )
            limits.check_content_type(get("Content-Type"), method, path)
        if key is not None and count:
            self.admit(key)
            self.check_budget(key, path)
        return key

    def _identify(self, get: Callable[[str], str | None], public: bool) -> ApiKey | None:
        """The key a client sent (set as the request's); on a public route, None without one
        (the request is the non-admin :data:`~trioshed.keys.PUBLIC`'s), else UnknownKey (401)."""
        authorization, x_api_key = get("Authorization"), get("x-api-key")
        # constant time, against every key and both headers: nothing tells how much of a guess was right
        key = self.keys.identify_headers(authorization, x_api_key)
        if public and (key is None or not self._fresh(key)):
            current_key.set(PUBLIC)  # a public route asks no key: a wrong or stale one is no key
            return None
        if key is None:
            presented = (authorization or "").removeprefix("Bearer ") or x_api_key or ""
            raise UnknownKey(
                f"secret:{digest(presented)}" if presented else "",
                "missing or wrong API key: send 'Authorization: Bearer <TRIOSHED_API_KEY>' or 'x-api-key: <TRIOSHED_API_KEY>'",
            )
        self._honoured(key)
        return key

    def _forwarded(self, method: str, path: str, get: Callable[[str], str | None]) -> ApiKey:
        """The key of a request another node forwarded here, once its signature held: the key it
        names as this node knows it (its role, models, limits and budgets are this node's
        record; a name it does not know is an UnknownKey), ANONYMOUS for no name where this node
        requires no keys. Its rate was counted where it arrived; it is served here."""
        signed = self.fleet.verify(method, path, get)  # 401 for a forged, changed or replayed request
        serve_here.set(True)
        if signed.key is None:
            if self.keys.required:
                raise Unauthorized(
                    f"node {signed.origin[:100]!r} forwarded a request without an API key, and this node requires one: "
                    "give every node of the fleet the same keys (TRIOSHED_API_KEY, TRIOSHED_KEYS_FILE or TRIOSHED_DATABASE)"
                )
            current_key.set(ANONYMOUS)
            return ANONYMOUS
        key = self.keys.by_name(signed.key)
        if key is None:
            raise UnknownKey(
                f"name:{signed.key}",
                f"API key '{signed.key[:100]}' is not known on this node (revoked, or not given to it): a forwarded "
                "request runs with the serving node's own record of its key",
            )
        self._honoured(key)
        return key

    def _fresh(self, key: ApiKey) -> bool:
        """Whether ``key`` is honoured now (see :meth:`_honoured`)."""
        try:
            if (sync := self.state.key_sync) is not None:
                sync.check_fresh(key)
        except TrioshedError:
            return False
        return True

    def _honoured(self, key: ApiKey) -> None:
        """``key`` as the request's (the scheduler counts its limits and share), once it is
        honoured now: KeysStale (503) for a key made over the API while the shared store has
        not been read for TRIOSHED_KEYS_STALE."""
        if (sync := self.state.key_sync) is not None:
            sync.check_fresh(key)
        current_key.set(key)
        if (trace := current_trace.get()) is not None:
            trace.key = key.name

    async def look_again(self, unknown: UnknownKey) -> bool:
        """Whether the shared store has keys this node did not know when ``unknown`` was raised
        (a key made on another node a moment ago): then the request is checked again. At most
        one reading of the store per short interval, shared by every request waiting for one
        (:meth:`trioshed.usage.keysync.KeySync.look_again`)."""
        sync = self.state.key_sync
        if sync is None or not unknown.credential:
            return False
        return await sync.look_again(unknown.credential)

    def admit(self, key: ApiKey) -> None:
        """Count a request of ``key`` against its rate; TooManyRequests when over it. A request
        another node forwarded was counted there."""
        if serve_here.get():
            return
        retry = self.rate.admit(key, time.monotonic())
        if retry is not None:
            raise TooManyRequests(key.name, "requests per minute", key.requests_per_minute, retry)

    def check_budget(self, key: ApiKey, path: str) -> None:
        """A key over one of its token budgets may not start a request that spends tokens (429,
        naming the key and the budget), on every route that may (``/upstream`` included), here
        and where another node forwarded it; the ledger answers from what was spent."""
        usage = self.state.usage
        if usage is None or not key.budgets() or not access.spends_tokens(path):
            return
        over = usage.refusal(key, time.time())  # every node's spends (a shared store)
        if over is not None:
            budget, limit, retry = over
            raise TooManyRequests(key.name, budget, limit, retry)

    def reload_keys(self) -> KeyRing:
        """Read the keys again (SIGHUP); ValueError, the old keys staying in force, when bad."""
        ring = keyring(self.state.settings.api_key, self.state.settings.keys_file, *self._stored())
        self.keys = ring
        self.state.keys = ring.keys
        return ring

    def _stored(self) -> tuple[tuple[ApiKey, ...], frozenset[str]]:
        """The store's keys in force and the names revoked there (trioshed.usage.keysync)."""
        sync = self.state.key_sync
        return (sync.stored, sync.revoked) if sync is not None else ((), frozenset())

    def cors(self, get: Callable[[str], str | None]) -> list[tuple[str, str]]:
        """The CORS headers for an allowed Origin (none without one)."""
        origin = get("Origin")
        if not origin or not self.origin_ok(origin, get("Host") or ""):
            return []
        return [
            ("Access-Control-Allow-Origin", origin),
            ("Vary", "Origin"),
            ("Access-Control-Allow-Headers", _ALLOW_HEADERS),
            ("Access-Control-Allow-Methods", "GET, POST, DELETE, HEAD, OPTIONS"),
        ]
