"""The record of one HTTP request, filled in by the layers it passes through.

The HTTP edge (:mod:`trioshed.api.observe`) creates a :class:`RequestTrace` for each request
and sets it in :data:`current` for the request's task (child tasks inherit it); the scheduler
writes the model and the waits when it grants a lease, the routes write token counts where
they know them. At the end the edge turns it into metrics and, when asked, one log line.

Plain data, no I/O: a contextvar lookup and a few attribute stores per request, never per
token.
"""

from __future__ import annotations

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

    def leased(self, model: str, queue_wait: float, load_wait: float) -> None:
        self.model = model
        self.queue_wait = queue_wait
        self.load_wait = load_wait

    def counted(self, answer: Any) -> None:
        """Token counts from a final Ollama chunk or an OpenAI answer, where present."""
        if not isinstance(answer, dict):
            return
        usage = answer.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        else:
            prompt, completion = answer.get("prompt_eval_count"), answer.get("eval_count")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.eval_tokens = completion


current: ContextVar[RequestTrace | None] = ContextVar("trioshed_request_trace", default=None)
