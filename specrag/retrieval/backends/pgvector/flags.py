"""The ``--pg-*`` flags of ``index build`` and ``serve`` (``--backend`` is the registry's).

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

__all__ = ["add_arguments", "add_stage_arguments"]


def add_arguments(parser: argparse._ActionsContainer, building: bool) -> None:
    """The ``--pg-*`` flags (``building``: the index build's, else serve's)."""
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
