"""The store ``serve()`` uses, from the settings: PostgreSQL when ``TRIOSHED_DATABASE`` names one
(a team of nodes), else the SQLite file (``TRIOSHED_USAGE_DB``, else the store's own:
:mod:`trioshed.usage.location`; none with ``TRIOSHED_USAGE=0``)."""

from __future__ import annotations

import socket

from trioshed.config import Settings
from trioshed.usage.db import UsageDB
from trioshed.usage.location import usage_file
from trioshed.usage.recorder import UsageRecorder
from trioshed.usage.store import Store


def build_store(settings: Settings) -> Store | None:
    if settings.database:
        # psycopg is imported only by a node with a team database
        from trioshed.usage.pg import PgStore

        return PgStore(settings.database)
    return UsageDB(usage_file(settings)) if settings.usage else None


def build_recorder(settings: Settings) -> UsageRecorder:
    return UsageRecorder(build_store(settings), node=settings.node_name or socket.gethostname(), fail_closed=settings.budgets_fail_closed)
