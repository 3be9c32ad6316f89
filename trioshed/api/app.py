"""The Quart-Trio application: routes, error handling, CORS and the optional API key.

The only package importing quart. Every TrioshedError becomes its status and headers with
the error body of the protocol serving the path (:mod:`trioshed.api.protocols.errors`: Ollama's
``{"error": message}``, on ``/v1/`` OpenAI's ``{"error": {"message", "type", "param", "code"}}``);
anything unexpected becomes a 500 with a short message (never a traceback).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from quart import Response, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trioshed import access
from trioshed.api import (
    anthropic,
    embed,
    events,
    fast,
    limits,
    manage,
    metrics,
    observe,
    ollama,
    ollama_models,
    openai,
    openapi,
    pin,
    pull,
    responses,
    ui,
)
from trioshed.api.protocols.errors import error_body, error_parts
from trioshed.api.state import AppState
from trioshed.errors import (
    Forbidden,
    PayloadTooLarge,
    TooManyRequests,
    TrioshedError,
    Unauthorized,
)
from trioshed.keys import ApiKey, RequestRate, current_key, keyring
from trioshed.trace import current as current_trace

log = logging.getLogger(__name__)

BODY_TIMEOUT = 120  # seconds for a whole request body (408 after): 32 MiB at >= 0.27 MB/s
#: What a browser may send cross-origin (the official JS clients' headers included).
_ALLOW_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, x-api-key, anthropic-version"


#: Routes that answer without reading the body (501, see trioshed.api.manage): a blob upload of
#: any size gets that answer rather than 413.
_UNREAD_BODIES = ("/api/blobs/", "/api/create", "/api/push", "/api/pull")


def _json_error(status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None) -> Response:
    """The error answer in the shape of the protocol serving the request's path."""
    path = request.path if has_request_context() else "/"
    response = Response(json.dumps(error_body(path, status, message, code)), status=status, content_type="application/json")
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response


class Gate:
    """Who may use the API: the Origin, the Host (against DNS rebinding), the API key and its
    rate, and the body's announced size and type. One instance per app; the Quart routes and
    the hot-route fast path (:mod:`trioshed.api.fast`) both ask it.

    ``get`` is a header lookup (case-insensitive name -> first value or None).
    """

    def __init__(self, state: AppState) -> None:
        self.origins = access.allowed_origins(state.settings.origins)
        self.check_host = access.is_loopback(state.settings.host)  # else the API key guards (serve says so)
        self.hostname = socket.gethostname()
        self.keys = keyring(state.settings.api_key, state.settings.keys_file)  # TRIOSHED_API_KEY, TRIOSHED_KEYS_FILE
        self.rate = RequestRate()
        self.max_body = state.settings.max_body

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
        public = method in ("GET", "HEAD") and (path == "/" or path in ui.PUBLIC)
        key = None
        if self.keys.required and not public:
            # constant time, against every key and both headers: nothing tells how much of a guess was right
            key = self.keys.identify_headers(get("Authorization"), get("x-api-key"))
            if key is None:
                raise Unauthorized(
                    "missing or wrong API key: send 'Authorization: Bearer <TRIOSHED_API_KEY>' or 'x-api-key: <TRIOSHED_API_KEY>'"
                )
            current_key.set(key)  # who the scheduler counts and shares slots for
            trace = current_trace.get()
            if trace is not None:
                trace.key = key.name
        if not path.startswith(_UNREAD_BODIES):
            if content_length is not None and content_length > self.max_body:
                raise PayloadTooLarge(
                    f"request body of {content_length} bytes exceeds the {self.max_body} byte limit (TRIOSHED_MAX_BODY)"
                )
            limits.check_content_type(get("Content-Type"), method)
        if key is not None and count:
            self.admit(key)
        return key

    def admit(self, key: ApiKey) -> None:
        """Count a request of ``key`` against its rate; TooManyRequests when over it."""
        retry = self.rate.admit(key, time.monotonic())
        if retry is not None:
            raise TooManyRequests(key.name, "requests per minute", key.requests_per_minute, retry)

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


def create_app(state: AppState) -> QuartTrio:
    app = QuartTrio("trioshed", static_folder=None)  # no /static/<path> route: nothing static is served
    app.config["TRIOSHED"] = state
    app.config["RESPONSE_TIMEOUT"] = None  # token streams may run for many minutes
    app.config["BODY_TIMEOUT"] = BODY_TIMEOUT
    max_body = state.settings.max_body
    app.config["MAX_CONTENT_LENGTH"] = max_body  # also bounds chunked bodies while they are read
    app.register_blueprint(ollama.bp)
    app.register_blueprint(ollama_models.bp)
    app.register_blueprint(openai.bp)
    app.register_blueprint(anthropic.bp)
    app.register_blueprint(responses.bp)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(embed.bp)
    app.register_blueprint(manage.bp)
    app.register_blueprint(pull.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(ui.bp)
    app.register_blueprint(events.bp)
    app.register_blueprint(pin.bp)
    app.config["TRIOSHED_METRICS"] = metrics.Metrics(state.scheduler, warm=state.warm)
    observe.install(app, app.config["TRIOSHED_METRICS"], log_json=state.settings.log_format == "json")
    gate = Gate(state)
    app.config["TRIOSHED_GATE"] = gate
    app.config["TRIOSHED_FAST"] = fast.FastPath(
        app,  # type: ignore[arg-type]  # Quart's ASGI types are narrower than the plain dicts
        state,
        gate,
        app.config["TRIOSHED_METRICS"],
        {
            "/api/generate": ollama.generate,
            "/api/chat": ollama.chat,
            "/v1/chat/completions": openai.chat_completions,
            "/v1/completions": openai.completions,
            "/v1/messages": anthropic.messages,
            "/v1/responses": responses.responses,
        },
        body_timeout=BODY_TIMEOUT,
        log_json=state.settings.log_format == "json",
    )

    @app.before_request
    async def _guard() -> Response | None:
        get = request.headers.get
        gate.check_origin(get)
        if request.method == "OPTIONS":
            return Response("", status=204)  # CORS preflight: browsers send it without credentials
        gate.check_request(request.method, request.path, get, request.content_length)
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        for name, value in gate.cors(request.headers.get):
            response.headers[name] = value
        return response

    @app.errorhandler(TrioshedError)
    async def _trioshed_error(exc: TrioshedError) -> Response:
        observe.note_error(exc)
        status, headers, body = error_parts(request.path, exc)
        return Response(body, status=status, headers=headers, content_type="application/json")

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        response = _json_error(status, exc.description or exc.name)
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)  # RFC 9110: a 405 says what is
        if status == 413:
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Any:
        log.exception("unhandled error on %s %s", request.method, request.path)
        status, headers, body = error_parts(request.path, exc)
        return Response(body, status=status, headers=headers, content_type="application/json")

    return app
