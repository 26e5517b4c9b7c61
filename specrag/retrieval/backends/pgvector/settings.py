"""The table's settings from the command line, typed and checked before any connection.

Apart from :mod:`~specrag.retrieval.backends.pgvector.assembly` so that reading them needs no
database driver (the registry reads every backend's settings it is asked for).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.config import (
    DEFAULT_POOL_SIZE,
    DEFAULT_SEARCH_TIMEOUT_S,
    Columns,
    LexicalChannel,
    PgSettings,
    StageMode,
    StageQueries,
    describe_dsn,
    resolve_dsn,
    search_timeout,
)

__all__ = [
    "DOCUMENTS_OFF",
    "SHARDS_REFUSED",
    "PgBuild",
    "PgServing",
    "build_settings",
    "serve_settings",
    "store_name",
]

# Why the documents API is off when the service may not write the table (its routes answer 501).
DOCUMENTS_OFF = (
    "the documents API cannot write to this pgvector table: change the table's rows with your own "
    "writer and restart the service (it reads the rows at start)"
)
# What a sharded pgvector is refused with: the database scales the table itself.
SHARDS_REFUSED = (
    "--search-shards splits the data directory's own index over Ray actors; --backend pgvector "
    "searches the database's table, which the database scales itself: give one of them"
)


@dataclass(frozen=True)
class PgBuild:
    """``index build --backend pgvector``'s flags: the table, and how to index it."""

    table: PgSettings
    metric: str
    index_method: str
    replace: bool


@dataclass(frozen=True)
class PgServing:
    """``serve --backend pgvector``'s flags: the table, what to check of it and how to search it."""

    table: PgSettings
    metric: str | None
    index_method: str | None
    lexical: LexicalChannel
    stage_mode: StageMode
    stages: StageQueries


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
    )


def store_name(settings: PgSettings) -> str:
    """A directory name for the table's document store: its table and a digest of where it is,
    so that two servers' tables of one name keep two stores (never the password)."""
    digest = hashlib.sha256(f"{describe_dsn(settings.dsn)}|{settings.table}".encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", settings.table)
    return f"pgvector-{safe}-{digest}"
