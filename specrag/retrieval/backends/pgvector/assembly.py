"""From command-line arguments to a loaded table or a served :class:`VectorIndex`.

``specrag index build --backend pgvector`` loads the corpus into a table (:func:`build_table`);
``specrag serve --backend pgvector`` searches one (:func:`open_index`): the table's rows are the
passages, the query embedder is the built-in one the build used (fitted on their texts as the
build fitted it) or the one the user brings for a table embedded by their own model, and the
lexical channel is specrag's BM25 over the same texts or (``--pg-lexical fts``) PostgreSQL's
full-text search of the rows, in the snapshot the vector stages read. The :class:`VectorIndex`
around the searcher is the in-process one, so the speculation policy, stage plan, timeline and
hybrid fusion are the same on both backends.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
import time
from collections.abc import Sequence

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.changes import install_change_trigger
from specrag.retrieval.backends.pgvector.config import (
    DEFAULT_LEXICAL,
    DEFAULT_POOL_SIZE,
    DEFAULT_STAGE_MODE,
    Columns,
    LexicalChannel,
    PgSettings,
    StageQueries,
    describe_dsn,
    resolve_dsn,
    search_timeout,
)
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.fulltext import check_fulltext
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_rows
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN, add_version_column
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index_store import IndexConfig, default_embedder
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.progress import embed_in_batches
from specrag.retrieval.search.stages import DEFAULT_STAGES
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["DOCUMENTS_OFF", "build_table", "close_index", "open_index", "settings_from", "store_name"]

logger = logging.getLogger(__name__)

# Why the documents API is off when the service may not write the table (its routes answer 501).
DOCUMENTS_OFF = (
    "the documents API cannot write to this pgvector table: change the table's rows with your own "
    "writer and restart the service (it reads the rows at start)"
)


def store_name(settings: PgSettings) -> str:
    """A directory name for the table's document store: its table and a digest of where it is,
    so that two servers' tables of one name keep two stores (never the password)."""
    digest = hashlib.sha256(f"{describe_dsn(settings.dsn)}|{settings.table}".encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", settings.table)
    return f"pgvector-{safe}-{digest}"


def settings_from(args: argparse.Namespace) -> PgSettings:
    """The table's settings from the flags (the DSN from ``$SPECRAG_PG_DSN`` when not given); the
    search deadline below ``serve``'s first-token timeout."""
    return PgSettings(
        dsn=resolve_dsn(args.pg_dsn),
        table=args.pg_table,
        columns=Columns.parse(args.pg_columns),
        statement_timeout_s=args.pg_statement_timeout,
        pool_size=getattr(args, "pg_pool_size", DEFAULT_POOL_SIZE),
        search_timeout_s=search_timeout(
            getattr(args, "pg_search_timeout", None), getattr(args, "first_token_timeout_s", None)
        ),
    )


def _texts(passages: Sequence[Passage]) -> list[str]:
    return [normalize_text(f"{passage.title}\n{passage.text}") for passage in passages]


def build_table(
    args: argparse.Namespace, passages: Sequence[Passage], config: IndexConfig, embedder: Embedder | None
) -> int:
    """Embed ``passages`` as the in-process build would and load them into the table."""
    settings = settings_from(args)
    started = time.perf_counter()
    texts = _texts(passages)
    if embedder is None:
        _, vectors = config.fit_and_embed(texts, progress=True)
    else:
        vectors = embed_in_batches(embedder, texts, show=True)
    layout = load_table(
        settings,
        passages,
        vectors,
        metric=args.pg_metric or "ip",
        nlist=config.nlist,
        replace=args.pg_replace,
        progress=True,
        index_method=args.pg_index,
    )
    index = "HNSW" if layout.method == "hnsw" else f"IVFFlat {layout.lists} lists"
    print(
        f"loaded {len(passages)} passages ({layout.dim} dims, {index}, {layout.metric}) "
        f"into {settings.where} in {time.perf_counter() - started:.1f}s"
    )
    return 0


def open_index(
    args: argparse.Namespace, embedder: Embedder | None = None, lexical: bool = True
) -> tuple[VectorIndex, list[Passage]]:
    """The table as a :class:`VectorIndex` and its rows as passages (row i = passage i).

    ``embedder`` embeds queries (a brought one: the model that embedded the table); without one,
    the built-in ``--embedder`` does, fitted on the rows' texts as ``index build`` fitted it. The
    dimension, columns and index are checked first: InvalidInputError names the column,
    DatabaseUnavailableError the host (both exit 2 at start).
    """
    settings = settings_from(args)
    database = Database(settings)
    fulltext = lexical and LexicalChannel(getattr(args, "pg_lexical", DEFAULT_LEXICAL)) is LexicalChannel.FTS
    try:
        layout = inspect_table(database, None, args.pg_metric, getattr(args, "pg_index", None))
        if fulltext:
            check_fulltext(database)
        documents_off = add_version_column(database)
        version_column = None if documents_off is not None else VERSION_COLUMN
        passages, versions = read_rows(database, version_column)
        texts = _texts(passages)
        if embedder is None:  # a built-in one: MiniLM as it is, WordLlama fitted on the rows
            embedder = IndexConfig(embedder=getattr(args, "embedder", None) or default_embedder()).fit(texts)
        if embedder.dim != layout.dim:
            raise InvalidInputError(
                f"column {settings.columns.embedding!r} of {settings.table} holds vector({layout.dim}), "
                f"the query embedder gives {embedder.dim} dimensions: use the model that embedded the table"
            )
        searcher = PgVectorSearcher(
            database,
            layout,
            [passage.id for passage in passages],
            nprobe=getattr(args, "ef_search" if layout.method == "hnsw" else "nprobe", None),
            mode=getattr(args, "pg_stage_mode", DEFAULT_STAGE_MODE),
            queried=getattr(args, "pg_stages", StageQueries.ENDS),
            versions=versions,
            version_column=version_column,
            fulltext=fulltext,
        )
        searcher.documents_off = documents_off
        if version_column is not None:
            searcher.changes_off = install_change_trigger(database)
            if searcher.changes_off is not None:
                logger.warning("%s", searcher.changes_off)
    except BaseException:
        database.close()
        raise
    index = VectorIndex(
        searcher,
        [passage.id for passage in passages],
        embedder=embedder,
        lexical=LexicalIndex.build(texts) if lexical and not fulltext else None,
        default_stages=DEFAULT_STAGES["ivf"],
    )
    logger.info("serving %d passages from %s: %s", len(passages), settings.where, searcher.settings)
    return index, passages


def close_index(index: VectorIndex) -> None:
    """Close the table's connections under ``index`` (one :func:`open_index` opened)."""
    if isinstance(index.searcher, PgVectorSearcher):
        index.searcher.close()
