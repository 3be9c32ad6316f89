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
from typing import Any

from quart import Response, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trioshed import access
from trioshed.api import (
    anthropic,
    embed,
    events,
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
from trioshed.api.protocols.errors import error_body
from trioshed.api.state import AppState
from trioshed.errors import (
    Forbidden,
    ModelNotFound,
    PayloadTooLarge,
    TooManyRequests,
    TrioshedError,
    Unauthorized,
)
from trioshed.keys import RequestRate, current_key, keyring
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
    origins = access.allowed_origins(state.settings.origins)
    check_host = access.is_loopback(state.settings.host)  # else the API key guards (serve says so)
    hostname = socket.gethostname()
    keys = keyring(state.settings.api_key, state.settings.keys_file)  # TRIOSHED_API_KEY, TRIOSHED_KEYS_FILE
    rate = RequestRate()

    def origin_ok(origin: str) -> bool:
        return access.same_origin(origin, request.headers.get("Host", "")) or access.origin_allowed(origin, origins)

    @app.before_request
    async def _guard() -> Response | None:
        # Origin and Host first: a request from a page that is not allowed does nothing at all
        origin = request.headers.get("Origin")
        host = request.headers.get("Host")
        if origin is not None and not origin_ok(origin):
            raise Forbidden(f"origin {origin[:200]!r} is not allowed; add it to TRIOSHED_ORIGINS to allow it")
        if check_host and not access.host_allowed(host, hostname):
            raise Forbidden(
                f"host {(host or '')[:200]!r} is not allowed: a server on a loopback address answers only to "
                "localhost, *.localhost, its IP addresses and this machine's name"
            )
        if request.method == "OPTIONS":
            return Response("", status=204)  # CORS preflight: browsers send it without credentials
        public = request.method in ("GET", "HEAD") and (request.path == "/" or request.path in ui.PUBLIC)
        if keys.required and not public:
            # constant time, against every key and both headers: nothing tells how much of a guess was right
            key = keys.identify_headers(request.headers.get("Authorization"), request.headers.get("x-api-key"))
            if key is None:
                raise Unauthorized(
                    "missing or wrong API key: send 'Authorization: Bearer <TRIOSHED_API_KEY>' or 'x-api-key: <TRIOSHED_API_KEY>'"
                )
            current_key.set(key)  # who the scheduler counts and shares slots for
            trace = current_trace.get()
            if trace is not None:
                trace.key = key.name
            retry = rate.admit(key, time.monotonic())
            if retry is not None:
                raise TooManyRequests(key.name, "requests per minute", key.requests_per_minute, retry)
        length = request.content_length
        if request.path.startswith(_UNREAD_BODIES):
            return None
        if length is not None and length > max_body:
            raise PayloadTooLarge(f"request body of {length} bytes exceeds the {max_body} byte limit (TRIOSHED_MAX_BODY)")
        limits.check_content_type(request.headers.get("Content-Type"), request.method)
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and origin_ok(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
            response.headers["Access-Control-Allow-Headers"] = _ALLOW_HEADERS
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, HEAD, OPTIONS"
        return response

    @app.errorhandler(TrioshedError)
    async def _trioshed_error(exc: TrioshedError) -> Response:
        observe.note_error(exc)
        code = "model_not_found" if isinstance(exc, ModelNotFound) else None
        response = _json_error(exc.status, exc.message, exc.headers, code)
        if exc.status == 413:
            response.headers["Connection"] = "close"  # a keep-alive client would hang otherwise
        return response

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
        # never the exception's text: it may hold paths or data; the log has it
        return _json_error(500, f"internal error ({type(exc).__name__}) on {request.path[:100]}; the server log has the details")

    return app
