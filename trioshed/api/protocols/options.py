"""Ollama ``options``: sampling parameters for llama-server and the runner overrides.

Pure (no I/O). Every protocol maps its own sampling fields onto these names; :func:`split_options`
turns them into llama-server's parameters and the overrides that choose or size a runner.
Also the small validators every protocol's request building uses (:func:`field`,
:func:`require_object`, :func:`json_type`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from trioshed.api.pipeline.limits import check_num_predict
from trioshed.errors import BadRequest

logger = logging.getLogger(__name__)

_INT, _FLOAT, _BOOL, _STOP = "int", "float", "bool", "stop"

#: Ollama sampling option -> (llama-server parameter, value kind).
_SAMPLING: dict[str, tuple[str, str]] = {
    "num_predict": ("n_predict", _INT),
    "temperature": ("temperature", _FLOAT),
    "top_k": ("top_k", _INT),
    "top_p": ("top_p", _FLOAT),
    "min_p": ("min_p", _FLOAT),
    "typical_p": ("typical_p", _FLOAT),
    "seed": ("seed", _INT),
    "stop": ("stop", _STOP),
    "repeat_penalty": ("repeat_penalty", _FLOAT),
    "repeat_last_n": ("repeat_last_n", _INT),
    "presence_penalty": ("presence_penalty", _FLOAT),
    "frequency_penalty": ("frequency_penalty", _FLOAT),
    "num_keep": ("n_keep", _INT),
    "mirostat": ("mirostat", _INT),
    "mirostat_tau": ("mirostat_tau", _FLOAT),
    "mirostat_eta": ("mirostat_eta", _FLOAT),
}
SAMPLING_OPTION_NAMES: Mapping[str, str] = {k: v[0] for k, v in _SAMPLING.items()}

#: Options that choose or size a runner (a different value may need a different runner).
_RUNNER: dict[str, str] = {
    "num_ctx": _INT,
    "num_batch": _INT,
    "num_gpu": _INT,
    "main_gpu": _INT,
    "use_mmap": _BOOL,
    "num_thread": _INT,
}
RUNNER_OPTION_KEYS: frozenset[str] = frozenset(_RUNNER)

#: Options Ollama accepts that mean nothing to llama-server: accepted and dropped, silently.
IGNORED_OPTION_KEYS: frozenset[str] = frozenset(
    {
        "penalize_newline",
        "tfs_z",
        "numa",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mlock",
        "embedding_only",
    }
)

_KIND_WORDS = {
    _INT: "an integer",
    _FLOAT: "a number",
    _BOOL: "true or false",
    _STOP: "a string or a list of strings",
}



def json_type(value: object) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _check_option(key: str, value: Any, kind: str) -> Any:
    """``value`` converted to ``kind``, or :class:`BadRequest` naming the option."""
    ok = True
    if kind == _INT:
        if isinstance(value, float) and math.isfinite(value):
            value = int(value)  # 5.0 from JSON clients; 1.5 truncated toward zero, as Ollama's FromMap does
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == _FLOAT:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif kind == _BOOL:
        ok = isinstance(value, bool)
    elif kind == _STOP:
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list | tuple) and all(isinstance(s, str) for s in value)
        value = list(value) if ok else value
    if not ok:
        raise BadRequest(
            f'option "{key}" must be {_KIND_WORDS[kind]}, got {json_type(value)} '
            f"{json.dumps(value, default=repr)}"
        )
    return value


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Ollama ``options`` into (llama-server sampling parameters, runner overrides).

    Sampling options are renamed to llama-server's names (``num_predict`` -> ``n_predict``,
    ``num_keep`` -> ``n_keep``; a negative ``num_predict``, Ollama's "no limit" -1 or "fill the
    context" -2, becomes -1). Runner overrides keep Ollama's names (:data:`RUNNER_OPTION_KEYS`).
    ``null`` values count as absent. Unknown keys are ignored with a warning, as Ollama does;
    a value of the wrong type is a :class:`BadRequest` naming the option.
    """
    if options is None:
        return {}, {}
    if not isinstance(options, Mapping):
        raise BadRequest(f'"options" must be an object, got {json_type(options)}')
    sampling: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in _SAMPLING:
            name, kind = _SAMPLING[key]
            value = _check_option(key, value, kind)
            if key == "num_predict":
                check_num_predict(value)
            if key == "num_predict" and value < 0:
                value = -1
            sampling[name] = value
        elif key in _RUNNER:
            runner[key] = _check_option(key, value, _RUNNER[key])
        elif key not in IGNORED_OPTION_KEYS:
            logger.warning("invalid option provided: %r (ignored)", key)
    return sampling, runner



def field(req: Mapping[str, Any], key: str, types: type | tuple[type, ...], words: str) -> Any:
    """``req[key]`` if present and of ``types`` (``None`` if absent or null), else BadRequest."""
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise BadRequest(f'"{key}" must be {words}, got {json_type(value)}')
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def require_object(req: object) -> Mapping[str, Any]:
    if not isinstance(req, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {json_type(req)}")
    return req
