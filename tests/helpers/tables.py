"""A pgvector table opened as the service opens it, searched by a test's own embedder."""

from __future__ import annotations

from specrag.retrieval.backends.pgvector.assembly import open_table
from specrag.retrieval.backends.pgvector.config import PgServing
from specrag.retrieval.backends.registry import around
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.vector_index import VectorIndex


def table_index(
    settings: PgServing, embedder: Embedder, lexical: bool = True
) -> tuple[VectorIndex, list[Passage]]:
    """The table as an index searched with ``embedder`` (the model that embedded it), and its rows
    as passages; ``lexical=False``: dense search only."""
    opened = open_table(settings, lambda name, texts: embedder, lexical)
    return around(opened), opened.passages
