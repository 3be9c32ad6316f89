"""The Quart-Trio application: routes, error handling, and the gate (origin, host, API key:
:mod:`trioshed.api.gate`) in Quart's hooks; the generating routes' fast path is built here too
(:mod:`trioshed.api.fast`). Every TrioshedError becomes its status and headers with
the error body of the protocol serving the path (:mod:`trioshed.api.protocols.errors`: Ollama's
``{"error": message}``, on ``/v1/`` OpenAI's ``{"error": {"message", "type", "param", "code"}}``);
anything unexpected becomes a 500 with a short message (never a traceback).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Response, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trioshed.api import (
    anthropic,
    embed,
    events,
    fast,
    keys,
    manage,
    metrics,
    observe,
    ollama,
    ollama_models,
    openai,
    openapi,
    pin,
    pull,
    rerank,
    responses,
    tools,
    ui,
    usage,
)
from trioshed.api.gate import Gate
from trioshed.api.protocols.errors import error_body, error_parts
from trioshed.api.state import AppState
from trioshed.errors import TrioshedError

log = logging.getLogger(__name__)

BODY_TIMEOUT = 120  # seconds for a whole request body (408 after): 32 MiB at >= 0.27 MB/s


def _json_error(status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None) -> Response:
    """The error answer in the shape of the protocol serving the request's path."""
    path = request.path if has_request_context() else "/"
    response = Response(json.dumps(error_body(path, status, message, code)), status=status, content_type="application/json")
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response


def create_app(state: AppState) -> QuartTrio:
    app = QuartTrio("trioshed", static_folder=None)  # no /static/<path> route: nothing static is served
    app.request_class = manage.StoreRequest  # blob uploads stream past TRIOSHED_MAX_BODY
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
    app.register_blueprint(rerank.bp)
    app.register_blueprint(manage.bp)
    app.register_blueprint(pull.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(ui.bp)
    app.register_blueprint(events.bp)
    app.register_blueprint(pin.bp)
    app.register_blueprint(tools.bp)
    app.register_blueprint(usage.bp)
    app.register_blueprint(keys.bp)  # the shared store's API keys (admin)
    app.config["TRIOSHED_METRICS"] = metrics.Metrics(state.scheduler, warm=state.warm)
    observe.install(
        app, app.config["TRIOSHED_METRICS"], log_json=state.settings.log_format == "json", finished=state.request_finished
    )
    gate = Gate(state)
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
