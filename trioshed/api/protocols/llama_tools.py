"""llama-server's own routes beside chat, routed by a ``model`` field, without I/O.

* ``POST /infill`` (fill-in-the-middle, what llama.vscode and llama.vim call),
  ``/tokenize``, ``/detokenize`` and ``/apply-template``: :func:`tool_body` checks the fields
  llama-server reads (its own checks answer 500 for a wrong type) and gives the body to forward,
  trioshed's fields (``model``, ``keep_alive``, ``options``) removed.
* ``/upstream/<model>/<path>``: :func:`split_upstream` finds the model and the llama-server path
  in the URL; :func:`upstream_allowed` is the one list of what may pass through.

Facts checked against llama-server b10068: ``/infill`` wants ``input_prefix`` and
``input_suffix`` strings, ``input_extra`` a list of ``{"filename", "text"}`` chunks and an
optional ``prompt`` (text after the prefix); without the model's FIM tokens it answers 501.
``/tokenize`` takes ``content``, ``add_special``, ``parse_special``, ``with_pieces``;
``/detokenize`` ``tokens`` (an id outside the vocabulary is a 500 there); ``/apply-template``
``messages`` (and ``tools``...) and answers ``{"prompt": ...}``.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

from trioshed.api.protocols.options import field, json_type, require_object
from trioshed.errors import BadRequest, Forbidden

#: trioshed's fields: they choose the runner and never go upstream.
OWN_FIELDS = ("model", "keep_alive", "options")

#: Each route's fields that llama-server reads with a fixed type: name -> (type, words).
_TYPED: dict[str, dict[str, tuple[type | tuple[type, ...], str]]] = {
    "/infill": {
        "input_prefix": (str, "a string"),
        "input_suffix": (str, "a string"),
        "input_extra": (list, 'a list of {"filename", "text"} objects'),
        "prompt": (str, "a string"),
        "stream": (bool, "true or false"),
        "n_predict": (int, "an integer"),
        "n_probs": (int, "an integer"),
        "post_sampling_probs": (bool, "true or false"),
        "temperature": ((int, float), "a number"),
        "top_k": (int, "an integer"),
        "top_p": ((int, float), "a number"),
        "seed": (int, "an integer"),
        "stop": (list, "a list of strings"),
        "cache_prompt": (bool, "true or false"),
    },
    "/tokenize": {
        "content": (str, "a string"),
        "add_special": (bool, "true or false"),
        "parse_special": (bool, "true or false"),
        "with_pieces": (bool, "true or false"),
    },
    "/detokenize": {"tokens": (list, "a list of token ids")},
    "/apply-template": {"messages": (list, "a list of messages"), "tools": (list, "a list of tools")},
}

#: The routes :func:`tool_body` knows.
TOOL_PATHS = tuple(_TYPED)

#: The most tokens /detokenize takes in one request (a large body could otherwise carry millions).
MAX_DETOKENIZE = 1 << 20

#: Routes that read no context (the tokenizer and the chat template): a loaded runner of the
#: model serves them whatever its context, so that counting a long prompt never reloads the
#: model at the context that prompt would need.
CONTEXT_FREE = frozenset({"/tokenize", "/detokenize", "/apply-template"})


def tool_body(path: str, req: Mapping[str, Any]) -> dict[str, Any]:
    """The llama-server body for a request to ``path`` (one of :data:`TOOL_PATHS`): ``req``
    less trioshed's fields, after checking the types llama-server would choke on (BadRequest)."""
    req = require_object(req)
    for name, (kind, words) in _TYPED[path].items():
        value = req.get(name)
        if value is None:
            continue
        wrong = isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,))
        if wrong or not isinstance(value, kind):
            raise BadRequest(f'"{name}" must be {words}, got {json_type(value)}')
    if path == "/infill":
        _check_extra(req.get("input_extra"))
        if isinstance(req.get("stop"), list) and not all(isinstance(s, str) for s in req["stop"]):
            raise BadRequest('"stop" must be a list of strings')
    elif path == "/detokenize":
        tokens = req.get("tokens") or []
        if len(tokens) > MAX_DETOKENIZE:
            raise BadRequest(f'"tokens" holds {len(tokens)} ids; send at most {MAX_DETOKENIZE} at a time')
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise BadRequest('"tokens" must be a list of token ids (integers from 0)')
    elif path == "/apply-template":
        messages = field(req, "messages", list, "a list of messages")
        if not messages:
            raise BadRequest('"messages" is required: a non-empty list of {"role", "content"} objects')
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise BadRequest(f'messages[{i}] must be an object with a "role" string')
    return {k: v for k, v in req.items() if k not in OWN_FIELDS}


def _check_extra(extra: object) -> None:
    for i, chunk in enumerate(extra if isinstance(extra, list) else []):
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text", ""), str) or not isinstance(chunk.get("filename", ""), str):
            raise BadRequest(f'input_extra[{i}] must be {{"filename": string, "text": string}}')


def infill_streams(body: Mapping[str, Any]) -> bool:
    """Whether an /infill answer streams (llama-server's default: whole)."""
    return body.get("stream") is True


# -- the pass-through --------------------------------------------------------------------------

#: What ``/upstream/<model>/<path>`` forwards: llama-server's reading and generating routes, each
#: served under a lease like every request. Not here, on purpose: ``/slots`` (reading it shows
#: other clients' prompts; its save, restore and erase actions write files and belong to warm
#: returns), ``POST /props`` and ``POST /lora-adapters`` (change a runner trioshed manages),
#: ``/lora-adapters`` (its answer names adapter files on disk), ``/models/load``/``unload``
#: (router mode), ``/metrics`` (off in trioshed's runners: use
#: trioshed's own ``/metrics``), the web UI.
UPSTREAM_GET = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models"})
UPSTREAM_POST = frozenset(
    {
        "/completion", "/completions", "/v1/completions",
        "/chat/completions", "/v1/chat/completions",
        "/infill", "/tokenize", "/detokenize", "/apply-template",
        "/embedding", "/embeddings", "/v1/embeddings",
        "/v1/messages", "/v1/messages/count_tokens",
    }
)  # fmt: skip
#: Paths whose runner must be started with ``--embeddings``.
UPSTREAM_EMBEDDING = frozenset({"/embedding", "/embeddings", "/v1/embeddings"})


def split_upstream(rest: str, raw: bytes = b"") -> list[tuple[str, str]]:
    """The ways to read ``rest`` (what follows ``/upstream/``) as ``<model>/<path>``, shortest
    model name first; forwarded paths (:func:`upstream_allowed`) before the others.

    Model names may hold slashes (``library/m:tag``, ``hf.co/org/repo:Q4``): the caller takes
    the first reading whose model exists. Raises BadRequest for a path that is not plain: ``.``
    or ``..`` segments, empty segments, backslashes, control characters, or (in ``raw``, the
    path as sent) an encoded slash, backslash or dot: nothing may step out of the runner's
    routes, whatever the encoding it arrived in.
    """
    lowered = raw.lower()
    if any(code in lowered for code in (b"%2f", b"%5c", b"%2e", b"%00")):
        raise BadRequest("upstream path must not hold encoded slashes, backslashes or dots")
    if "\\" in rest or any(ord(c) < 0x20 or c == "\x7f" for c in rest):
        raise BadRequest("upstream path must not hold backslashes or control characters")
    parts = rest.split("/")
    if len(parts) < 2 or any(p in ("", ".", "..") for p in parts) or posixpath.normpath("/" + rest) != "/" + rest:
        raise BadRequest("upstream path must be /upstream/<model>/<llama-server path>, without empty, '.' or '..' segments")
    readings = [("/".join(parts[:cut]), "/" + "/".join(parts[cut:])) for cut in range(1, len(parts))]
    known = UPSTREAM_GET | UPSTREAM_POST
    return sorted(readings, key=lambda r: r[1] not in known)  # stable: shortest model first within each


def upstream_allowed(method: str, path: str) -> None:
    """Raise unless ``method path`` may pass through to a runner: Forbidden (403) for what is
    never forwarded, BadRequest (405 is the route's) for a method the path does not take."""
    if path.startswith("/slots"):
        raise Forbidden("/slots is not forwarded: slot contents belong to other requests, and saving or restoring slots is trioshed's (warm returns)")
    if method in ("GET", "HEAD") and path in UPSTREAM_GET:
        return
    if method == "POST" and path in UPSTREAM_POST:
        return
    if method == "POST" and path in UPSTREAM_GET:
        raise Forbidden(f"POST {path} is not forwarded: it would change a runner trioshed manages")
    raise Forbidden(f"{method} {path} is not forwarded to llama-server; see the list of forwarded routes in docs/api.md")


def upstream_target(rest: str, query: bytes) -> str:
    """The llama-server path with the request's query string (already percent-encoded)."""
    return rest + ("?" + query.decode("ascii", "replace") if query else "")


def scrub_props(raw: bytes, name: str) -> bytes:
    """``GET /props``'s answer without the model file's path (``model_path``, which names a
    folder on the server): the model's name stands in its place, what a web UI shows."""
    try:
        props = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(props, dict) or "model_path" not in props:
        return raw
    props["model_path"] = name
    return json.dumps(props, ensure_ascii=False).encode()
