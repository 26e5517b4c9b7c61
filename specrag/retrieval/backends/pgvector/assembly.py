"""From command-line flags to a loaded table or an opened one.

``specrag index build --backend pgvector`` loads the corpus into a table (:func:`build_table`);
``specrag serve --backend pgvector`` searches one (:func:`open_table`): the table's rows are the
passages, the query embedder is the one that embedded the table (a built-in one fitted on their
texts as the build fitted it, or the one the user brings), and the lexical channel is specrag's
BM25 over the same texts or (``--pg-lexical fts``) PostgreSQL's full-text search of the rows, in
the snapshot the vector stages read. The registry (:mod:`specrag.retrieval.backends.registry`)
puts the index facade around the opened table, so the speculation policy, stage plan, timeline
and hybrid fusion are the same on every backend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.changes import install_change_trigger
from specrag.retrieval.backends.pgvector.config import (
    DOCUMENTS_OFF,
    LexicalChannel,
    PgBuild,
    PgServing,
    store_name,
)
from specrag.retrieval.backends.pgvector.database import Database, DatabaseUnavailableError
from specrag.retrieval.backends.pgvector.deadline import Deadline
from specrag.retrieval.backends.pgvector.fulltext import check_fulltext
from specrag.retrieval.backends.pgvector.searcher import NO_CHANGE_TRIGGER, PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_rows
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN, add_version_column
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.text import normalize_text

__all__ = ["OpenTable", "build_table", "database_health", "open_table", "passage_texts"]

logger = logging.getLogger(__name__)


def passage_texts(passages: Sequence[Passage]) -> list[str]:
    """What the table's vectors embed: each passage's title and text, normalised as questions are."""
    return [normalize_text(f"{passage.title}\n{passage.text}") for passage in passages]


def build_table(
    settings: PgBuild, passages: Sequence[Passage], vectors: np.ndarray, nlist: int, started: float
) -> str:
    """Load ``passages`` and their ``vectors`` into the table; returns the line saying so, with the
    time since ``started`` (``time.perf_counter``'s: the embedding's included)."""
    layout = load_table(
        settings.table,
        passages,
        vectors,
        metric=settings.metric,
        nlist=nlist,
        replace=settings.replace,
        progress=True,
        index_method=settings.index_method,
    )
    index = "HNSW" if layout.method == "hnsw" else f"IVFFlat {layout.lists} lists"
    return (
        f"loaded {len(passages)} passages ({layout.dim} dims, {index}, {layout.metric}) "
        f"into {settings.table.where} in {time.perf_counter() - started:.1f}s"
    )


@dataclass(frozen=True)
class OpenTable:
    """A table opened for serving: its searcher, its rows as passages (row i = passage i), the
    query embedder and specrag's BM25 over the rows' texts (None: the table's full-text search,
    or no lexical channel). The table is the documents' record; their store is kept under
    ``DATA_DIR/external/store_name``."""

    searcher: PgVectorSearcher
    passages: list[Passage]
    embedder: Embedder
    lexical: LexicalIndex | None
    store_name: str
    documents_off: str = DOCUMENTS_OFF

    @property
    def table(self) -> PgVectorSearcher:
        return self.searcher

    def close(self) -> None:
        self.searcher.close()

    def health(self, bound_s: float) -> dict[str, Any]:
        return database_health(self.searcher, bound_s)


def open_table(
    settings: PgServing, fit: Callable[[str, Sequence[str]], Embedder], lexical: bool = True
) -> OpenTable:
    """The table checked and opened. Questions are embedded by the brought embedder, else by
    ``fit``'s built-in one fitted on the rows' texts as ``index build`` fitted it. The dimension,
    columns and index are checked first: InvalidInputError names the column,
    DatabaseUnavailableError the host (both exit 2 at start). ``lexical=False``: no lexical
    channel (a test's or a benchmark's dense search)."""
    brought = settings.embedder.brought()  # first: a bad choice fails before the database is reached
    database = Database(settings.table)
    fulltext = lexical and settings.lexical is LexicalChannel.FTS
    try:
        layout = inspect_table(database, None, settings.metric, settings.index_method)
        if fulltext:
            check_fulltext(database)
        documents_off = add_version_column(database)
        version_column = None if documents_off is not None else VERSION_COLUMN
        passages, versions = read_rows(database, version_column)
        texts = passage_texts(passages)
        embedder = brought or fit(settings.embedder.name, texts)
        if embedder.dim != layout.dim:
            raise InvalidInputError(
                f"column {settings.table.columns.embedding!r} of {settings.table.table} holds "
                f"vector({layout.dim}), the query embedder gives {embedder.dim} dimensions: use the "
                "model that embedded the table"
            )
        changes_off: str | None = NO_CHANGE_TRIGGER
        if version_column is not None:
            changes_off = install_change_trigger(database)
            if changes_off is not None:
                logger.warning("%s", changes_off)
        searcher = PgVectorSearcher(
            database,
            layout,
            [passage.id for passage in passages],
            mode=settings.stage_mode,
            queried=settings.stages,
            versions=versions,
            version_column=version_column,
            fulltext=fulltext,
            documents_off=documents_off,
            changes_off=changes_off,
        )
    except BaseException:
        database.close()
        raise
    logger.info("serving %d passages from %s: %s", len(passages), settings.table.where, searcher.settings)
    bm25 = LexicalIndex.build(texts) if lexical and not fulltext else None
    return OpenTable(searcher, passages, embedder, bm25, store_name(settings.table))


def database_health(searcher: PgVectorSearcher, bound_s: float) -> dict[str, Any]:
    """Whether the table's database answers one round trip within ``bound_s`` (and the search
    deadline), for ``/health``: a database that does not fails every query."""
    deadline = Deadline.after(min(bound_s, searcher.database.settings.search_timeout_s))
    try:
        with searcher.database.connection(deadline) as connection:
            connection.execute("SELECT 1")
    except DatabaseUnavailableError as error:
        logger.warning("/health: %s", error)  # where it is, for the operator's log only
        return {"serving": False, "database": "unavailable", "reason": "the database does not answer"}
    return {"serving": True, "database": "answers"}
