"""Each protocol's sampling defaults and a model's options under a request's own (pure), and a
body sent as the client wrote it with the added members before its own."""

from __future__ import annotations

import json

from trioshed.api.protocols import sampling


def test_what_a_request_does_not_set_comes_from_the_first_layer_that_has_it() -> None:
    body = {"model": "m", "temperature": 0.2, "top_p": None}
    model = {"temperature": 0.7, "top_k": 7, "stop": ["zzz"]}
    assert sampling.missing(body, model, sampling.OPENAI) == {
        "top_k": 7, "stop": ["zzz"], "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip


def test_a_models_length_goes_in_only_where_the_request_sets_none() -> None:
    model = {"n_predict": 3, "temperature": 0.5}
    assert sampling.model_sampling_for_openai(model, {"messages": []}) == model
    for length in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        assert sampling.model_sampling_for_openai(model, {length: 9}) == {"temperature": 0.5}


def test_ollamas_defaults_are_its_default_options() -> None:
    # api/types.go DefaultOptions(), as Ollama's llama-server runner sends them
    assert dict(sampling.OLLAMA) == {"n_keep": 4, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
                                     "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip
    assert sampling.OPENAI["temperature"] == sampling.ANTHROPIC["temperature"] == 1.0


def test_a_raw_body_gets_the_added_members_first_and_stays_as_sent() -> None:
    raw = b'  {"model": "m", "messages": [{"role": "user", "content": "\\u00e9"}]}'
    out = sampling.spliced(raw, {"temperature": 1.0, "top_k": 0})
    assert out is not None and out.endswith(b'"model": "m", "messages": [{"role": "user", "content": "\\u00e9"}]}')
    assert json.loads(out) == {"temperature": 1.0, "top_k": 0, **json.loads(raw)}
    assert json.loads(sampling.spliced(b"{ }", {"a": 1}) or b"") == {"a": 1}
    assert sampling.spliced(raw, {}) == raw
    assert sampling.spliced(b"[1]", {"a": 1}) is None


def test_a_greedy_request_gets_no_cut_that_is_off() -> None:
    """At temperature 0 the cuts that keep every token change no token and cost a pass over the
    whole vocabulary each step: they are left out, unless probabilities are asked for."""
    defaults = {**sampling.OPENAI, "top_k": 0}
    greedy = sampling.greedy_trimmed(defaults, {"temperature": 0})
    assert "top_k" not in greedy and "top_p" not in greedy and "min_p" not in greedy
    assert greedy["presence_penalty"] == 0.0  # not a cut: kept
    assert sampling.greedy_trimmed(defaults, {"temperature": 0.2}) == defaults
    assert sampling.greedy_trimmed(defaults, {}) == defaults  # the default temperature 1
    assert "top_k" not in sampling.greedy_trimmed({**defaults, "temperature": 0.0}, {})  # the model's 0
    assert sampling.greedy_trimmed(defaults, {"temperature": -1}).keys() == greedy.keys()
    assert sampling.greedy_trimmed(defaults, {"temperature": 0, "logprobs": True}) == defaults
    assert sampling.greedy_trimmed(defaults, {"temperature": 0, "n_probs": 3}) == defaults
    assert sampling.greedy_trimmed({"top_k": 7, "top_p": 0.5}, {"temperature": 0}) == {"top_k": 7, "top_p": 0.5}
    assert sampling.greedy_trimmed(defaults, {"temperature": False}) == defaults  # not a number
    # what goes under a request's own: the first layer that sets a parameter, less the cuts that are off
    assert sampling.under({"temperature": 0}, {"top_k": 7}, sampling.OPENAI) == {"top_k": 7, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert sampling.under({}, {}, sampling.ANTHROPIC) == dict(sampling.ANTHROPIC)
