"""A real PostgreSQL for the tests that share a store (the team store, the fleet through its
database): Debian's server started in a temporary folder by :mod:`trioshed.testing.postgres`, one
per session, and a fresh database per test. Where PostgreSQL is not installed these tests are
skipped, except under ``.ci/run`` (``TRIOSHED_TEST_NEEDS_POSTGRES`` set), where they fail."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest

from trioshed.testing.postgres import Postgres, find_bin, running_postgres

NO_POSTGRES = find_bin() is None
if NO_POSTGRES and os.environ.get("TRIOSHED_TEST_NEEDS_POSTGRES"):
    raise RuntimeError("CI: PostgreSQL is not installed (apt-get install postgresql); the team tests need it")
needs_postgres = pytest.mark.skipif(NO_POSTGRES, reason="PostgreSQL is not installed (apt-get install postgresql)")
_names = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    if NO_POSTGRES:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    with running_postgres() as pg:
        yield pg


def fresh_database(pg: Postgres) -> str:
    """A new, empty database on ``pg``: its URL."""
    name = f"t{os.getpid()}_{next(_names)}"
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    return pg.url.rsplit("/", 1)[0] + "/" + name
