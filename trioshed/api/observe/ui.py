"""``GET /ui``: the status page, three static files in the package (no build step, no CDN).

The page reads everything it shows from one stream, ``GET /api/events`` (see
:mod:`trioshed.api.observe.events`), and acts through the ordinary API (``/api/generate`` to load and
unload, ``/api/pin``). Its files are served without the API key (they hold no data; the page
asks for the key and sends it on its own requests), with a Content-Security-Policy that lets it
load and connect to nothing but this server.
"""

from __future__ import annotations

from importlib import resources

from quart import Blueprint, Response

bp = Blueprint("ui", __name__)

#: Nothing from elsewhere: scripts, styles and connections to this origin only, no inline code,
#: no frames, no form posts, no plugins.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_TYPES = {
    "ui.html": "text/html; charset=utf-8",
    "ui.js": "text/javascript; charset=utf-8",
    "ui.css": "text/css; charset=utf-8",
}
_FILES = {name: (resources.files("trioshed.api") / "static" / name).read_bytes() for name in _TYPES}
#: The paths that answer without the API key (the page itself asks for it).
PUBLIC = frozenset({"/ui", "/ui/ui.js", "/ui/ui.css"})


def _file(name: str) -> Response:
    response = Response(_FILES[name], content_type=_TYPES[name])
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"  # a new trioshed's page, not yesterday's
    return response


@bp.get("/ui")
async def page() -> Response:
    return _file("ui.html")


@bp.get("/ui/ui.js")
async def script() -> Response:
    return _file("ui.js")


@bp.get("/ui/ui.css")
async def style() -> Response:
    return _file("ui.css")
