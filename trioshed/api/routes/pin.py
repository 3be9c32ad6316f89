"""``POST /api/pin {"model", "pinned"}``: pin or unpin a model until trioshed restarts.

trioshed's addition (the status page's Pin/Unpin buttons use it). Pinned is what ``pinned = true``
in models.toml means (never evicted to make room, kept loaded unless a request's own keep_alive
says otherwise), for this run only: models.toml is not changed. A model not loaded now is pinned
when it loads. An unknown model is 404 and changes nothing.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint

from trioshed.api.pipeline.preamble import read_body, state
from trioshed.errors import BadRequest, ModelNotFound
from trioshed.keys import current_key

bp = Blueprint("pin", __name__)


@bp.post("/api/pin")
async def pin() -> Any:
    st = state()
    body = await read_body()
    name, pinned = body.get("model"), body.get("pinned", True)
    if not isinstance(name, str) or not name.strip():
        raise BadRequest('"model" is required')
    if not isinstance(pinned, bool):
        raise BadRequest('"pinned" must be true or false')
    spec = await trio.to_thread.run_sync(st.store.resolve, name)
    if not current_key.get().may_use(spec.name):
        raise ModelNotFound(name)
    loaded = st.scheduler.pin(spec, pinned)
    return {"model": spec.name, "pinned": pinned, "loaded": loaded}
