"""Where a server's usage database is when ``TRIOSHED_USAGE_DB`` does not say.

The database holds the API keys made over the API (as digests) and every key's usage, so it
belongs to one server's store: by default it is ``<store>.usage.db`` beside the models folder
(``/data/a`` -> ``/data/a.usage.db``), on the disk the store is on, and two stores in one folder
(``/data/a`` and ``/data/b``, two stores in ``/tmp``) have two. A server never shares another's
keys by default, so it never starts refusing requests for keys it was not given.

Before this, the default was ``usage.db`` beside the models folder, shared by every store in that
folder. Such a file keeps working for its store: the first server that finds it beside its store
(and no file of its own) claims it by writing its store's path to ``usage.db.store`` beside it,
and uses it from then on; a server with another store in that folder starts a file of its own.
To keep two servers sharing one file, give both the same ``TRIOSHED_USAGE_DB``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trioshed.config import Settings

log = logging.getLogger(__name__)

LEGACY = "usage.db"


def usage_file(settings: Settings) -> Path:
    """The SQLite file this server records usage in (see the module docstring). Blocking: reads
    (and may write) the claim beside an older file."""
    own = settings.usage_path
    if settings.usage_db is not None or own.exists():
        return own
    legacy = own.parent / LEGACY
    if not legacy.exists():
        return own
    store = str(own.parent.resolve() / own.name.removesuffix(".usage.db"))
    claim = legacy.with_name(LEGACY + ".store")
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:  # a folder that cannot be written: the new file could not be either
        log.warning("usage: cannot claim %s for the store %s (%s); using %s", legacy, store, exc, own)
        return own
    else:
        with os.fdopen(fd, "w") as f:
            f.write(store + "\n")
        log.info("usage: %s (the usage database of earlier versions) is the store %s's from now on", legacy, store)
        return legacy
    try:
        owner = claim.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return own
    return legacy if owner == store else own
