"""How the HTTP edge counts a request's prompt, for the scheduler's count-then-fit.

A generating route hands the scheduler its request's size and a count function
(:func:`prompt_fit`); the scheduler decides when to count, on which runner, and what follows
(served, grown, a 400 or a 507: :mod:`trioshed.core.fit`). Counting is the edge's part because
it is the protocol's: a chat's messages are rendered by the runner's template
(``/apply-template``), then the text is tokenized (``/tokenize``), as llama-server will when it
serves the request. Where llama-server itself finds the prompt too long
(``exceed_context_size_error``), its answer becomes the same error
(:func:`trioshed.api.protocols.errors.context_error`); its own words ("llama-server
answered…") never reach a client.
"""

from __future__ import annotations

import json
from typing import Any

from trioshed.api.pipeline.drain import bounded
from trioshed.api.pipeline.preamble import Prepared
from trioshed.api.pipeline.upstream import json_answer, upstream_error
from trioshed.scheduler.contracts import CountOn, PromptFit

_CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_PROMPT_PATHS = ("/completion", "/completions", "/v1/completions")


def prompt_fit(prepared: Prepared, path: str, body: dict[str, Any] | bytes) -> PromptFit:
    """What the scheduler needs to fit ``prepared``'s prompt, going to ``path`` with ``body``, to
    a runner's context (``Scheduler.acquire(..., fit=...)``)."""

    async def count(on: CountOn) -> int | None:
        return await prompt_tokens(on, path, body)

    return PromptFit(prepared.need, prepared.output, prepared.automatic, count)


async def prompt_tokens(on: CountOn, path: str, body: dict[str, Any] | bytes) -> int | None:
    """The exact number of tokens the runner will see for ``body`` on ``path`` (None: a shape
    not counted here, e.g. a prompt of token ids or media, which llama-server then checks).
    Raises the runner's failures (ConnectionFailed, RunnerStalled) for the scheduler to act on."""
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
    if path in _CHAT_PATHS:
        if _has_media(body.get("messages")):
            return None
        rendered = await _post(on, "/apply-template", {k: v for k, v in body.items() if k != "stream"})
        text = rendered.get("prompt")
    elif path in _PROMPT_PATHS:
        text = body.get("prompt")
    else:
        return None
    if not isinstance(text, str):
        return None
    tokens = await _post(on, "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    ids = tokens.get("tokens")
    return len(ids) if isinstance(ids, list) else None


async def _post(on: CountOn, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the runner; its JSON answer. Bounded like every wait on a runner
    (RunnerStalled); a non-200 answer raises its error; a runner that cannot be reached raises
    ConnectionFailed (the scheduler tells a death from a blip: ``Lease.death``)."""
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    status, raw = await bounded(lambda: on.upstream.post(path, payload), on.model.name)
    if status != 200:
        raise upstream_error(raw, status)
    return json_answer(raw)


def _has_media(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") not in (None, "text") for p in content
        ):
            return True
    return False
