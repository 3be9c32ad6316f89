"""``trioshed run`` with a base model: one that brings no chat template (like the demo's Gemma 3
270M) continues the text it is given; it does not answer it as a chat model would.

``run`` says so once, on standard error, with the way to a chat model (:func:`notice`). A one-shot
``run`` of such a model writes one paragraph of continuation: it asks for at most
:data:`CONTINUATION_TOKENS` tokens (unless the model's own options set ``num_predict``) and stops
reading at the first paragraph break after some text (:class:`Paragraph`), where a person reading
a continuation expects it to end; a base model left alone writes until its context is full, and a
small one repeats itself long before. A chat with such a model goes through the server's plain
transcript, which ends at the next turn; each answer is held to the same length.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = ["CHAT_MODEL", "CONTINUATION_TOKENS", "Paragraph", "base_model_of", "is_base_model", "notice", "one_shot_of_base_model", "with_length"]

#: The most tokens one continuation of a base model's takes in ``run`` (about 90 words).
CONTINUATION_TOKENS = 128

#: A small chat model to suggest (Ollama's registry).
CHAT_MODEL = "llama3.2:1b"


def is_base_model(show: Mapping[str, Any]) -> bool:
    """Whether ``/api/show``'s answer is a generating model without a chat template."""
    caps = show.get("capabilities")
    generates = not isinstance(caps, list) or "completion" in caps
    return generates and not show.get("template")


def notice(model: str) -> str:
    """The line ``run`` writes once, on standard error, for a base model."""
    return (
        f"{model} is a base model (no chat template): it continues your text rather than answering it. "
        f"For a chat model: trioshed pull {CHAT_MODEL}"
    )


def with_length(body: dict[str, Any], show: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``options.num_predict`` at :data:`CONTINUATION_TOKENS`, unless the request or
    the model's own parameters (``/api/show``'s ``parameters``) already set one."""
    options = body.get("options") or {}
    if "num_predict" in options or "num_predict" in str(show.get("parameters") or "").split():
        return body
    return {**body, "options": {**options, "num_predict": CONTINUATION_TOKENS}}


class Paragraph:
    """A streamed continuation, cut at its first paragraph break (a blank line) after some text.

    :meth:`feed` takes each piece as it comes and returns what may be written now; a single
    newline at the end is held back until the next piece says whether a blank line follows.
    ``done`` turns true at the break: the caller stops reading (closing the request).
    """

    def __init__(self) -> None:
        self.text = ""
        self.written = 0
        self.done = False

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        self.text += piece
        start = len(self.text) - len(self.text.lstrip())
        if start == len(self.text):  # only white space so far: nothing to cut at yet
            end = len(self.text)
        else:
            brk = self.text.find("\n\n", start)
            if brk >= 0:
                self.done = True
                end = brk
            else:
                end = len(self.text) - (1 if self.text.endswith("\n") else 0)
        out = self.text[self.written : end]
        self.written = max(self.written, end)
        return out

    def rest(self) -> str:
        """What is held back when the stream ends without a break."""
        if self.done:
            return ""
        out = self.text[self.written :]
        self.written = len(self.text)
        return out


def model_show(client: httpx.Client, model: str) -> dict[str, Any] | None:
    """``/api/show``'s answer for ``model``, or None where it was refused (``run`` then says why)."""
    response = client.post("/api/show", json={"model": model})
    return response.json() if response.status_code < 400 else None  # type: ignore[no-any-return]


def one_shot_of_base_model(client: httpx.Client, body: dict[str, Any], verbose: bool) -> tuple[dict[str, Any], Paragraph | None]:
    """A one-shot ``run``'s request, and its paragraph cut where the model is a base model (said
    once on standard error; :mod:`~trioshed.cli.base_model`). ``--verbose`` reads to the end, for
    the timings, within the same length."""
    show = model_show(client, body["model"])
    if show is None or base_model_of(body["model"], show) is None:
        return body, None
    return with_length(body, show), None if verbose else Paragraph()


def base_model_of(model: str, show: Mapping[str, Any]) -> dict[str, Any] | None:
    """For a chat: ``show`` where ``model`` is a base model (said once on standard error), else None."""
    if not is_base_model(show):
        return None
    print(notice(model), file=sys.stderr, flush=True)
    return dict(show)
