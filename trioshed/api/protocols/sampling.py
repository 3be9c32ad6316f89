"""What a request samples with where it says nothing: each protocol's own defaults, and a model's.

llama-server's own defaults (b10068: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) belong to
no protocol a client speaks. On every generating route, the first that sets a parameter wins:

1. the request's own (Ollama's ``options``; OpenAI's and Anthropic's fields),
2. the model's options (``models.toml``'s ``options``, an Ollama Modelfile's ``PARAMETER`` lines),
3. the protocol's defaults below,
4. llama-server's.

* Ollama's routes: Ollama's ``DefaultOptions()`` (``api/types.go``, read in August 2026), as its own
  llama-server runner sends them: ``num_keep`` 4, ``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.9,
  ``min_p`` 0, ``typical_p`` 1, ``repeat_last_n`` 64, ``repeat_penalty`` 1, no presence or
  frequency penalty (``num_predict`` -1 and a random ``seed`` are llama-server's defaults too).
* OpenAI's routes (Chat Completions, Completions, Responses): the API reference's defaults,
  ``temperature`` 1 and ``top_p`` 1, no presence or frequency penalty; OpenAI's API has no other
  cut of the distribution, so none is made (``top_k`` 0 and ``min_p`` 0: off).
* Anthropic's Messages API: ``temperature`` 1 (its documented default); ``top_p`` and ``top_k``
  apply only when asked, so they are off (1 and 0), and so is ``min_p``.

A request that samples greedily (``temperature`` 0 or below, from the request or the model) gets
the argmax whatever the cuts, so the cuts that are off (``top_k`` 0, ``top_p`` 1, ``min_p`` 0)
are not sent there (:func:`greedy_trimmed`): a ``top_k`` of 0 makes llama-server carry the whole
vocabulary through every sampler of every step (262,144 tokens for Gemma 3: 6% fewer tokens/s on
a CPU, measured), for the same tokens; the request then samples as llama-server alone does with
the same body. Not where it asks for probabilities (``logprobs``, ``top_logprobs``, ``n_probs``),
which the cuts can change.

Pure (no I/O); the names are llama-server's, which its native and OpenAI-compatible endpoints
both read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ANTHROPIC", "OLLAMA", "OPENAI", "greedy_trimmed", "missing", "model_sampling_for_openai", "spliced", "under"]

OLLAMA: Mapping[str, Any] = {
    "n_keep": 4,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

OPENAI: Mapping[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

ANTHROPIC: Mapping[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}

#: Fields of an OpenAI body that say how long the answer may be (llama-server reads ``n_predict``
#: before them, so a model's ``num_predict`` goes in only where the request sets none).
_OPENAI_LENGTH = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


def missing(body: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of ``layers`` that ``body`` does not set (absent or null), each from the
    first layer that has it: what goes under the request's own."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in out and body.get(key) is None:
                out[key] = value
    return out


#: The cuts of the distribution at their "off" values: each keeps every token.
_NO_CUT: Mapping[str, float] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
_PROBABILITIES = ("logprobs", "top_logprobs", "n_probs")


def greedy_trimmed(params: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` (going under ``body``) without the cuts that are off, where the request samples
    greedily and asks for no probabilities (see the module docstring)."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = params.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature <= 0
    if not greedy or any(body.get(k) for k in _PROBABILITIES):
        return dict(params)
    return {k: v for k, v in params.items() if not (k in _NO_CUT and v == _NO_CUT[k])}


def under(body: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """What goes under ``body``'s own parameters from ``layers`` (the model's, then the
    protocol's): :func:`missing`, less the cuts that are off where the request is greedy."""
    return greedy_trimmed(missing(body, *layers), body)


def model_sampling_for_openai(sampling: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """A model's sampling options (llama-server's names, from ``split_options``) for an OpenAI
    body: its ``n_predict`` only where the body sets no length of its own (llama-server reads
    ``n_predict`` before ``max_tokens``)."""
    if any(body.get(k) is not None for k in _OPENAI_LENGTH):
        return {k: v for k, v in sampling.items() if k != "n_predict"}
    return dict(sampling)


def spliced(raw: bytes, extra: Mapping[str, Any]) -> bytes | None:
    """``raw``, a JSON object's bytes as the client sent them, with ``extra``'s members first
    (keys ``raw`` does not have: no key twice), or None where ``raw`` is not an object's text.
    The body then goes upstream without being written again."""
    text = raw.lstrip()
    if not text.startswith(b"{") or not extra:
        return None if not text.startswith(b"{") else raw
    head = json.dumps(extra, separators=(",", ":")).encode()[:-1]  # '{"a":1,"b":2' without its '}'
    rest = text[1:].lstrip()
    return head + (rest if rest.startswith(b"}") else b"," + rest)
