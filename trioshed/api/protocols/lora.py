"""The per-request ``lora`` list in llama-server's request bodies (pure).

A runner of an adapter group (:mod:`trioshed.core.adapters`) holds the adapters of several
models; each request says which apply with ``lora: [{"id", "scale"}, …]``, every adapter the
runner loaded listed (its model's at their scales, the others at 0). The list is the lease's
(``LeaseView.lora``: the ids are the runner's, and a request that runs again on a new runner
gets that runner's), set here, for every protocol, into the body its builder made, just before
it goes to the runner:

- on the paths that honour it (:data:`trioshed.core.adapters.LORA_PATHS`: ``/completion``,
  ``/v1/completions``, ``/v1/chat/completions``, ``/infill``) the list replaces any the client
  sent (a client's ids would name the runner's adapters, which it cannot know);
- on a generating or embedding path that ignores it (llama-server's own ``/v1/messages`` and
  ``/v1/responses``, embeddings, rerank), a runner that selects per request would apply every
  adapter at 1.0: refused (400) rather than answered wrongly. trioshed's own routes never send
  such a request to a group's runner (Anthropic's messages go through the chat route);
  ``/upstream/<model>/…`` can;
- other paths (``/tokenize``, ``/apply-template``…) involve no adapter: unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from trioshed.core.adapters import LORA_PATHS
from trioshed.errors import BadRequest

__all__ = ["IGNORED", "with_lora"]

#: llama-server's paths that compute with the model but ignore a request's ``lora`` (b10068).
IGNORED = frozenset({
    "/v1/messages", "/v1/responses", "/responses", "/embedding", "/embeddings", "/v1/embeddings",
    "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
})  # fmt: skip


def with_lora(path: str, body: dict[str, Any] | bytes, lora: list[dict[str, Any]] | None, *, selects: bool) -> dict[str, Any] | bytes:
    """``body`` for ``path`` with the request's ``lora`` list (None: the runner loaded no
    adapter; ``selects``: it selects them per request). A JSON body given as bytes is parsed
    and written again (one that is not a JSON object is left for llama-server to refuse)."""
    if lora is None:
        return body
    target = path.partition("?")[0]
    if target in LORA_PATHS:
        if isinstance(body, bytes):
            try:
                parsed = json.loads(body)
            except ValueError:
                return body
            if not isinstance(parsed, dict):
                return body
            return json.dumps({**parsed, "lora": lora}, ensure_ascii=False, separators=(",", ":")).encode()
        return {**body, "lora": lora}
    if selects and target in IGNORED:
        raise BadRequest(
            f"llama-server's {target} cannot select this model's LoRA adapters (it would apply every adapter of "
            "its runner): use trioshed's own route for it (/v1/messages, /v1/responses, /api/chat...)"
        )
    return body
