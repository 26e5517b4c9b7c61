"""The ``--backend`` and ``--pg-*`` flags of ``index build`` and ``serve``.

Apart from the rest of the package so that registering the flags needs no database driver:
the driver is imported only when ``--backend pgvector`` is chosen.
"""

from __future__ import annotations

import argparse

from specrag.retrieval.backends.pgvector.config import (
    DEFAULT_LEXICAL,
    DEFAULT_POOL_SIZE,
    DEFAULT_SEARCH_TIMEOUT_S,
    DEFAULT_STAGE_MODE,
    DEFAULT_STATEMENT_TIMEOUT_S,
    DSN_ENV,
    INDEX_METHODS,
    METRICS,
    LexicalChannel,
    StageMode,
    StageQueries,
)
from specrag.retrieval.index_store import EMBEDDER_ENV, MINILM, WORDLLAMA, default_embedder

__all__ = [
    "BACKENDS",
    "DEFAULT_EMBEDDER_TIMEOUT_S",
    "QUERY_EMBEDDERS",
    "add_arguments",
    "add_stage_arguments",
]

# Where the vectors live: specrag's own index directory, or a PostgreSQL table with pgvector.
BACKENDS = ("local", "pgvector")
# The built-in embedders a service may embed questions with (TF-IDF's fitted state lives only in
# an index directory, which a served index loads with it).
QUERY_EMBEDDERS = (MINILM, WORDLLAMA)
# Seconds an embedding server may take to embed a question: a GPU server's are milliseconds.
DEFAULT_EMBEDDER_TIMEOUT_S = 5.0


def add_arguments(parser: argparse._ActionsContainer, building: bool) -> None:
    """The ``--backend`` and ``--pg-*`` flags (``building``: the index build's, else serve's)."""
    parser.add_argument(
        "--backend", choices=BACKENDS, default="local", help="where the vectors live (default: local)"
    )
    parser.add_argument(
        "--pg-dsn",
        help=f"PostgreSQL connection string (else ${DSN_ENV}, which keeps a password off the command line)",
    )
    parser.add_argument(
        "--pg-table", default="specrag_passages", help="table [SCHEMA.]NAME (default: %(default)s)"
    )
    parser.add_argument(
        "--pg-columns",
        help="the table's columns as id=…,title=…,text=…,embedding=… (default: those names)",
    )
    parser.add_argument(
        "--pg-metric",
        choices=tuple(METRICS),
        default=None,
        help="the IVFFlat index's metric (default: ip to build, "
        "checked against the table's index to serve when given)",
    )
    parser.add_argument(
        "--pg-statement-timeout",
        type=float,
        default=DEFAULT_STATEMENT_TIMEOUT_S,
        help="seconds a query may take",
    )
    parser.add_argument(
        "--pg-index",
        choices=tuple(INDEX_METHODS),
        default="ivfflat" if building else None,
        help="the vector index to build (default: ivfflat)"
        if building
        else "the vector index to search, checked against the table's (default: IVFFlat, else HNSW)",
    )
    if building:
        parser.add_argument("--pg-replace", action="store_true", help="drop the table first if it exists")
        return
    # The query side (index build has these already): it must be what embedded the index.
    parser.add_argument(
        "--embedder",
        choices=(*QUERY_EMBEDDERS, "sentence-transformers", "openai"),
        default=default_embedder(),
        help="what embeds questions: what embedded the index, else the service refuses to start "
        f"(default: ${EMBEDDER_ENV}, else {MINILM}, as index build and prepare embed; wordllama is "
        "fitted on the passages as they fit it); openai: an OpenAI-compatible embedding server serving "
        "the index's model (--embedder-url, --embedder-model); sentence-transformers: with --backend "
        "pgvector",
    )
    parser.add_argument("--embedder-model", help="model directory, or the model name a server serves")
    parser.add_argument("--embedder-url", help="base URL of an OpenAI-compatible /v1/embeddings server")
    parser.add_argument("--embedder-key-env", help="environment variable holding the server's API key")
    parser.add_argument(
        "--embedder-timeout",
        type=float,
        default=DEFAULT_EMBEDDER_TIMEOUT_S,
        metavar="SECONDS",
        help="each call to the embedding server: past it the question answers 504 embedding_timeout "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--pg-pool-size", type=int, default=DEFAULT_POOL_SIZE, help="connections held at most"
    )
    parser.add_argument(
        "--pg-search-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a search's bound on the client, every stage and the wait for a connection included: "
        "past it the search is cut off and the query answers 503 database_unavailable; below "
        f"--first-token-timeout (default: {DEFAULT_SEARCH_TIMEOUT_S:g}, or half the first-token "
        "timeout when shorter)",
    )
    add_stage_arguments(parser)
    parser.add_argument(
        "--pg-lexical",
        choices=[str(channel) for channel in LexicalChannel],
        default=str(DEFAULT_LEXICAL),
        help="hybrid search's lexical channel: fts, PostgreSQL's full-text search in the stages' "
        "snapshot (needs the tsvector column index build adds); bm25, specrag's over the texts "
        "read at start (default: %(default)s)",
    )


def add_stage_arguments(parser: argparse._ActionsContainer) -> None:
    """How a pgvector search is staged (``--pg-stage-mode``, ``--pg-stages``): ``serve``'s flags,
    and a benchmark's that stages a table the same way."""
    parser.add_argument(
        "--pg-stage-mode",
        choices=[str(mode) for mode in StageMode],
        default=str(DEFAULT_STAGE_MODE),
        help="parallel: the final query on its own connection (not delayed); sequential: one connection",
    )
    parser.add_argument(
        "--pg-stages",
        choices=[str(queried) for queried in StageQueries],
        default=str(StageQueries.ENDS),
        help="ends: query the stage plan's first and final stages only (each stage re-scans the "
        "lists of the one before); every: each stage of the plan",
    )
