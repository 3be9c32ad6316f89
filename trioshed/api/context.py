"""A prompt too long for its context, found before the answer starts (each protocol's 400).

The automatic context (``trioshed.core.context``) is sized from an upper bound on a request's
tokens, so a request whose bound fits its runner's context needs no count at all. One whose bound
does not (a prompt near or past the model's trained context, or a ``num_ctx`` set smaller) is
counted exactly by the runner it leased (``/apply-template`` then ``/tokenize``: ~20 ms for
80 KB of text on gemma3 270M) before any answer is sent, so that even a streamed request gets
its protocol's 400 rather than a 200 that ends in an error event. Where llama-server itself finds
the prompt too long (``exceed_context_size_error``), :func:`context_error` turns its answer into
the same error;
its own words ("llama-server answered…") never reach a client
(:func:`trioshed.api.protocols.errors.context_error`).

Where the automatic context was made smaller to fit the memory (the scheduler's ``floor``, its
lease's ``shrunk``), the same count decides: a prompt the smaller runner holds is served; one it
does not grows the runner to the bucket of its count (``Lease.regrow``) where the larger size
would only have split the model with system memory, and is a 507
(:class:`~trioshed.errors.ContextOutOfMemory`) naming its tokens and the memory where every size
between was just found not to fit; one longer than the size asked for (the model's trained
context) is the 400 as before.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, NamedTuple

from trioshed.api.preamble import Prepared, output_budget
from trioshed.api.upstream import post_upstream
from trioshed.core.context import FLOOR, PER_MESSAGE, bucket, slot_context
from trioshed.core.model import RunnerOptions
from trioshed.errors import ContextOutOfMemory, ContextTooLong, TrioshedError
from trioshed.scheduler import Lease, Scheduler

_CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_PROMPT_PATHS = ("/completion", "/completions", "/v1/completions")


async def prompt_tokens(lease: Lease, path: str, body: dict[str, Any] | bytes) -> int | None:
    """The exact number of tokens the runner will see for ``body`` on ``path`` (None: a shape
    not counted here, e.g. a prompt of token ids or media, which llama-server then checks)."""
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
        rendered = await post_upstream(lease, "/apply-template", {k: v for k, v in body.items() if k != "stream"})
        text = rendered.get("prompt")
    elif path in _PROMPT_PATHS:
        text = body.get("prompt")
    else:
        return None
    if not isinstance(text, str):
        return None
    tokens = await post_upstream(lease, "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    ids = tokens.get("tokens")
    return len(ids) if isinstance(ids, list) else None


async def ensure_fits(lease: Lease, path: str, body: dict[str, Any] | bytes, need: int) -> None:
    """Raise ContextTooLong when ``body``'s prompt does not fit the leased runner's slot (or
    ContextOutOfMemory, a 507, where the runner's context was made smaller to fit the memory
    and the size asked for would hold it); a request whose upper bound ``need`` fits is not
    counted. A count that fails for another reason is left to llama-server (whose own error is
    translated the same way)."""
    n_ctx = slot_context(lease.options)
    if need <= n_ctx:
        return
    try:
        n = await prompt_tokens(lease, path, body)
    except TrioshedError as exc:
        if isinstance(exc, ContextTooLong):
            raise
        return
    if n is None or n < n_ctx:
        return
    shrunk = lease.shrunk
    if shrunk is None:
        raise ContextTooLong(n, n_ctx)
    asked = slot_context(replace(lease.options, num_ctx=shrunk.asked))
    if n >= asked:
        raise ContextTooLong(n, asked)
    if not shrunk.fits_larger:  # every size up to the one asked was just found not to fit
        raise ContextOutOfMemory(lease.model.name, n, n_ctx, shrunk.tried, shrunk.why)
    output = output_budget(body) if isinstance(body, dict) else 0
    await lease.regrow(min(shrunk.asked, bucket(n + max(PER_MESSAGE, output))))


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


class Fit(NamedTuple):
    """How to lease a request (:func:`fit_loaded`)."""

    options: RunnerOptions
    need: int  # the upper bound to give :func:`ensure_fits` (0: counted already)
    floor: int  # the smallest automatic num_ctx it may load at (0: never lowered; Scheduler.acquire)


async def fit_loaded(scheduler: Scheduler, prepared: Prepared, path: str, body: dict[str, Any] | bytes) -> Fit:
    """The options to lease ``prepared`` by, counting its prompt on the model's loaded runner
    when its automatic context would otherwise reload it at a larger size: a prompt the runner
    holds (with its output budget) is served there, one longer than the model takes is refused
    (ContextTooLong) without a load, and one between grows the context to the bucket of its
    exact count, not of the byte bound. Without a loaded runner, or with ``num_ctx`` set, the
    options are returned as they are (a load counts later, :func:`ensure_fits`). Also returned:
    the ``need`` to give :func:`ensure_fits` (0 once counted here) and the ``floor`` to lease
    by: an automatic size not counted may be made as small as :data:`FLOOR` to fit the memory,
    one counted no smaller than the bucket of its count."""
    options = prepared.options
    unsized = Fit(options, prepared.need, min(FLOOR, options.num_ctx) if prepared.automatic else 0)
    loaded = scheduler.loaded_options(prepared.model) if prepared.automatic else None
    if loaded is None or loaded.num_ctx >= options.num_ctx:
        return unsized
    on_loaded = replace(options, num_ctx=loaded.num_ctx)
    if not can_serve_options(loaded, on_loaded):
        return unsized
    async with scheduler.acquire(prepared.model, on_loaded, prepared.keep_alive) as lease:
        try:
            n = await prompt_tokens(lease, path, body)
        except ContextTooLong:
            raise
        except TrioshedError:
            return unsized
    if n is None:
        return unsized
    if n >= slot_context(options):
        raise ContextTooLong(n, slot_context(options))
    if n + prepared.output < slot_context(on_loaded):
        return Fit(on_loaded, 0, on_loaded.num_ctx)
    grown = replace(options, num_ctx=min(options.num_ctx, bucket(n + prepared.output + PER_MESSAGE)))
    return Fit(grown, 0, grown.num_ctx)


def can_serve_options(have: RunnerOptions, want: RunnerOptions) -> bool:
    """Whether a runner with ``have`` serves a request with ``want`` (as the scheduler decides)."""
    if have.embedding and not want.embedding:
        want = replace(want, embedding=True)
    if want.num_gpu < 0:
        want = replace(want, num_gpu=have.num_gpu)
    return have == want
