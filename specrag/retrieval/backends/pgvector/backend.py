"""What the registry registers of pgvector: the table's settings from the command line, typed
and checked before any connection, its load (``index build``) and its open (``serve``).

Apart from :mod:`~specrag.retrieval.backends.pgvector.assembly`, which the load and the open
import when called, so that registering pgvector and reading its settings need no database
driver: only a command that builds or serves a table imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.config import (
    DEFAULT_POOL_SIZE,
    DEFAULT_SEARCH_TIMEOUT_S,
    Columns,
    LexicalChannel,
    PgBuild,
    PgServing,
    PgSettings,
    StageMode,
    StageQueries,
    resolve_dsn,
    search_timeout,
)
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.choice import EmbedderChoice
from specrag.retrieval.embedders.embedder import Embedder

if TYPE_CHECKING:
    from specrag.retrieval.backends.pgvector.assembly import OpenTable

__all__ = ["SHARDS_REFUSED", "build_settings", "load", "open_served", "serve_settings", "settings"]

# What a sharded pgvector is refused with: the database scales the table itself.
SHARDS_REFUSED = (
    "--search-shards splits the data directory's own index over Ray actors; --backend pgvector "
    "searches the database's table, which the database scales itself: give one of them"
)


def _table_settings(
    args: argparse.Namespace,
    pool_size: int = DEFAULT_POOL_SIZE,
    search_timeout_s: float = DEFAULT_SEARCH_TIMEOUT_S,
) -> PgSettings:
    """The table's settings from the flags (the DSN from ``$SPECRAG_PG_DSN`` when not given)."""
    return PgSettings(
        dsn=resolve_dsn(args.pg_dsn),
        table=args.pg_table,
        columns=Columns.parse(args.pg_columns),
        statement_timeout_s=args.pg_statement_timeout,
        pool_size=pool_size,
        search_timeout_s=search_timeout_s,
    )


def build_settings(args: argparse.Namespace) -> PgBuild:
    """``index build``'s settings; a sharded table is refused (the database scales it)."""
    if args.shards > 1:
        raise InvalidInputError(
            f"--shards {args.shards} splits the data directory's own index; --backend pgvector loads "
            "the database's table, which the database scales itself: give one of them"
        )
    return PgBuild(_table_settings(args), args.pg_metric or "ip", args.pg_index, args.pg_replace)


def serve_settings(args: argparse.Namespace) -> PgServing:
    """``serve``'s settings, the search deadline below its first-token timeout; shards refused,
    and a ``--corpus``: the table's rows are the corpus."""
    if args.search_shards is not None:
        raise InvalidInputError(SHARDS_REFUSED)
    if args.corpus:
        raise InvalidInputError("--corpus: with --backend pgvector the table's rows are the corpus")
    return PgServing(
        table=_table_settings(
            args, args.pg_pool_size, search_timeout(args.pg_search_timeout, args.first_token_timeout_s)
        ),
        metric=args.pg_metric,
        index_method=args.pg_index,
        lexical=LexicalChannel(args.pg_lexical),
        stage_mode=StageMode(args.pg_stage_mode),
        stages=StageQueries(args.pg_stages),
        embedder=EmbedderChoice.from_args(args),
    )


def settings(args: argparse.Namespace, building: bool) -> PgBuild | PgServing:
    """``index build``'s settings (``building``) or ``serve``'s."""
    return build_settings(args) if building else serve_settings(args)


def load(
    settings: PgBuild | PgServing,
    passages: Sequence[Passage],
    embed: Callable[[Sequence[str]], np.ndarray],
    nlist: int,
    started: float,
) -> str:
    """Embed ``passages`` (``embed``: as ``index build`` was told) and load them into the table
    (:func:`assembly.build_table`); returns the line that says so."""
    assert isinstance(settings, PgBuild), "index build reads the build's settings"
    from specrag.retrieval.backends.pgvector.assembly import build_table, passage_texts

    return build_table(settings, passages, embed(passage_texts(passages)), nlist, started)


def open_served(settings: PgBuild | PgServing, fit: Callable[[str, Sequence[str]], Embedder]) -> OpenTable:
    """The table opened for serving (:func:`assembly.open_table`); ``fit`` gives the built-in
    embedder of a name fitted on the rows' texts."""
    assert isinstance(settings, PgServing), "serve reads the service's settings"
    from specrag.retrieval.backends.pgvector.assembly import open_table

    return open_table(settings, fit)
