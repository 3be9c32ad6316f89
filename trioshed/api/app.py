"""The Quart-Trio application: its routes, and the request wrapper (:mod:`trioshed.api.pipeline.wrapper`:
trace, gate, errors, CORS) attached through Quart's hooks; the generating routes' fast path
(:mod:`trioshed.api.pipeline.fast_path`) is built here too and calls the same wrapper. Every TrioshedError
becomes its status and headers with the error body of the protocol serving the path
(:mod:`trioshed.api.protocols.errors`: Ollama's ``{"error": message}``, on ``/v1/`` OpenAI's
``{"error": {"message", "type", "param", "code"}}``); anything unexpected becomes a 500 with a
short message (never a traceback).
"""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from trioshed.api.observe import events, metrics, ui
from trioshed.api.openapi import document as openapi
from trioshed.api.pipeline import fast_path, fleet, upstream
from trioshed.api.pipeline.gate import Gate
from trioshed.api.pipeline.wrapper import ASGIApp, RequestWrapper
from trioshed.api.routes import (
    anthropic,
    embed,
    keys,
    llama,
    manage,
    ollama,
    ollama_models,
    openai,
    pin,
    pull,
    rerank,
    responses,
    transcriptions,
    usage,
)
from trioshed.api.state import AppState
from trioshed.fleet.auth import current_signed

BODY_TIMEOUT = 120  # seconds for a whole request body (408 after): 32 MiB at >= 0.27 MB/s


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
    app.register_blueprint(rerank.bp)
    app.register_blueprint(manage.bp)
    app.register_blueprint(pull.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(ui.bp)
    app.register_blueprint(events.bp)
    app.register_blueprint(pin.bp)
    app.register_blueprint(llama.bp)
    app.register_blueprint(usage.bp)
    app.register_blueprint(transcriptions.bp)
    app.register_blueprint(keys.bp)  # the shared store's API keys (admin)
    app.register_blueprint(fleet.bp)
    routed = fleet.routed if state.fleet is not None else (lambda view: view)  # in a fleet: any request may go to another node
    for endpoint, view in list(app.view_functions.items()):
        app.view_functions[endpoint] = routed(view)  # type: ignore[arg-type]
    upstream.batching.window = state.settings.stream_batch
    upstream.batching.from_streams = state.settings.stream_batch_from
    app.config["TRIOSHED_METRICS"] = metrics.Metrics(state.scheduler, warm=state.warm, usage=state.usage)
    wrapper = RequestWrapper(
        Gate(state),
        app.config["TRIOSHED_METRICS"],
        log_json=state.settings.log_format == "json",
        finished=state.request_finished,
    )
    # Quart's own ASGI callable: traced when called as the app, untraced for the fast path
    # (which traces every request itself). Quart's ASGI types are narrower than the plain dicts.
    quart_asgi: ASGIApp = app.asgi_app  # type: ignore[assignment]
    app.asgi_app = wrapper.traced_app(quart_asgi)  # type: ignore[method-assign,assignment]
    generating = {
        "/api/generate": ollama.generate,
        "/api/chat": ollama.chat,
        "/v1/chat/completions": openai.chat_completions,
        "/v1/completions": openai.completions,
        "/v1/messages": anthropic.messages,
        "/v1/responses": responses.responses,
    }
    app.config["TRIOSHED_FAST"] = fast_path.FastPath(
        quart_asgi,
        state,
        wrapper,
        {path: routed(view) for path, view in generating.items()} if state.settings.fast_routes else {},  # blob uploads are served there always
        body_timeout=BODY_TIMEOUT,
    )

    # Quart's hooks: thin adapters over the wrapper, which the fast path calls directly.
    @app.before_request
    async def _enter() -> Response | None:
        route = request.url_rule.rule if request.url_rule is not None else None
        entry = await wrapper.enter_or_look_again(request.method, request.path, request.headers.get, request.content_length, route=route)
        if current_signed.get() is not None:  # another node's request: the body it signed, read now (and kept)
            wrapper.check_body(await request.get_data(cache=True, as_text=False, parse_form_data=False))
        return Response("", status=204) if entry.preflight else None

    @app.after_request
    async def _finish(response: Response) -> Response:
        for name, value in wrapper.finish(request.headers.get, response.status_code):
            response.headers[name] = value
        return response

    @app.errorhandler(Exception)
    async def _error(exc: Exception) -> Response:
        answer = wrapper.on_error(request.method, request.path, exc)
        return Response(answer.body, status=answer.status, headers=answer.headers, content_type="application/json")

    return app
