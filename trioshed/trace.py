"""The record of one HTTP request, filled in by the layers it passes through.

The HTTP edge (:mod:`trioshed.api.observe.request_log`) creates a :class:`RequestTrace` for each request
and sets it in :data:`current` for the request's task (child tasks inherit it); the scheduler
writes the model and the waits when it grants a lease, the routes write token counts where
they know them. At the end the edge turns it into metrics and, when asked, one log line.

Plain data, no I/O: a contextvar lookup and a few attribute stores per request, never per
token.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestTrace:
    method: str
    path: str
    client: str
    started: float  # time.monotonic()
    route: str = ""  # the url rule ("/api/chat", "/v1/models/<model>"); "" = no route matched
    status: int = 0  # 0 = no response was made (the client left first)
    model: str = ""  # the model a lease was granted on
    queue_wait: float | None = None  # seconds from arrival at the scheduler to the lease, loads included
    load_wait: float | None = None  # seconds of that spent loading the runner (first request on it)
    prompt_tokens: int | None = None
    eval_tokens: int | None = None
    error: str = ""  # for a 503, its cause: queue_full, cooldown, shutting_down
    key: str = ""  # the API key's name ("" = no keys configured); never the key itself
    prompt_seconds: float | None = None  # llama-server's prompt processing time, where reported
    eval_seconds: float | None = None  # its generation time, where reported
    restore_seconds: float | None = None  # a saved conversation restored before the request (warm returns)
    cached_tokens: int | None = None  # of the prompt, tokens llama-server took from its cache

    @property
    def gen_seconds(self) -> float:
        """Prompt processing and generation, as llama-server timed them (0 where not reported)."""
        return (self.prompt_seconds or 0.0) + (self.eval_seconds or 0.0)

    def leased(self, model: str, queue_wait: float, load_wait: float) -> None:
        self.model = model
        self.queue_wait = queue_wait
        self.load_wait = load_wait

    def counted_anthropic(self, usage: Any) -> None:
        """Token counts from an Anthropic ``usage`` (input tokens exclude the cached ones)."""
        if isinstance(usage, dict):
            cached = usage.get("cache_read_input_tokens") or 0
            self.prompt_tokens = (usage.get("input_tokens") or 0) + cached
            self.eval_tokens = usage.get("output_tokens") or 0
            self.cached_tokens = cached

    def counted_sse(self, data: bytes) -> None:
        """Token counts from the last events of an OpenAI stream (its ``usage`` and ``timings``)."""
        for line in data.split(b"\n"):
            if line.startswith(b"data: {") and (b'"usage"' in line or b'"timings"' in line):
                try:
                    self.counted(json.loads(line[6:]))
                except ValueError:
                    continue

    def counted(self, answer: Any, timings: Any = None) -> None:
        """Token counts from a final Ollama chunk or an OpenAI answer, where present; cached
        tokens and generation time from llama-server's ``timings`` (in the answer or given)."""
        if not isinstance(answer, dict):
            return
        usage = answer.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        elif "prompt_eval_count" in answer or "eval_count" in answer:
            prompt, completion = answer.get("prompt_eval_count"), answer.get("eval_count")
        else:
            prompt = completion = None
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.eval_tokens = completion
        timings = timings if isinstance(timings, dict) else answer.get("timings")  # llama-server's own
        if isinstance(timings, dict):
            prompt_ms, eval_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
            if isinstance(prompt_ms, int | float):
                self.prompt_seconds = prompt_ms / 1000
            if isinstance(eval_ms, int | float):
                self.eval_seconds = eval_ms / 1000
            if isinstance(timings.get("cache_n"), int):
                self.cached_tokens = timings["cache_n"]
            if prompt is None and isinstance(timings.get("prompt_n"), int):  # a stream without usage
                self.prompt_tokens = timings["prompt_n"] + (self.cached_tokens or 0)
            if completion is None and isinstance(timings.get("predicted_n"), int):
                self.eval_tokens = timings["predicted_n"]
        prompt_ns, eval_ns = answer.get("prompt_eval_duration"), answer.get("eval_duration")  # Ollama's
        if isinstance(prompt_ns, int) and prompt_ns > 0:
            self.prompt_seconds = prompt_ns / 1e9
        if isinstance(eval_ns, int) and eval_ns > 0:
            self.eval_seconds = eval_ns / 1e9


current: ContextVar[RequestTrace | None] = ContextVar("trioshed_request_trace", default=None)
