"""A trioshed served in-process on an ephemeral port, for tests and the bench harness."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from trioshed.config import Settings
from trioshed.server import Server, serve


@asynccontextmanager
async def open_test_server(
    models: Path, *, record: list[tuple[str, str]] | None = None, **overrides: object
) -> AsyncIterator[Server]:
    """Serve ``models`` on 127.0.0.1:<free port> with one runner thread; stop and reap on exit.

    Warm returns are off (``kv_cache_budget=0``) unless an override turns them on with its own
    ``kv_cache_dir``: tests never write into the user's cache folder."""
    settings = Settings(host="127.0.0.1", port=0, models=models, num_thread=1, kv_cache_budget=0).with_(**overrides)
    async with trio.open_nursery() as nursery:
        server: Server = await nursery.start(partial(serve, settings, handle_signals=False, record=record))
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel(reason="test server closed")
