"""Where the table lives and how its columns are named, and saying where without the password.

A DSN may hold a password, so it comes from ``--pg-dsn`` or, better, ``$SPECRAG_PG_DSN`` (not on
the command line, where ``ps`` shows it), and is never echoed: every message names the server by
:func:`describe_dsn` (host, port, database, user), the DSN itself is kept out of ``repr`` and
:func:`scrub` removes the password from any text a driver produced before it is shown.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
from dataclasses import dataclass, field, fields

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders.choice import EmbedderChoice

__all__ = [
    "BULK_READ_TIMEOUT_S",
    "DEFAULT_HNSW_EF_SEARCH",
    "DEFAULT_LEXICAL",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_SEARCH_TIMEOUT_S",
    "DEFAULT_STAGE_MODE",
    "DEFAULT_STATEMENT_TIMEOUT_S",
    "DOCUMENTS_OFF",
    "DSN_ENV",
    "INDEX_METHODS",
    "METRICS",
    "Columns",
    "LexicalChannel",
    "PgBuild",
    "PgServing",
    "PgSettings",
    "StageMode",
    "StageQueries",
    "bounded_conninfo",
    "describe_dsn",
    "resolve_dsn",
    "scrub",
    "search_timeout",
    "store_name",
]

DSN_ENV = "SPECRAG_PG_DSN"
# Every statement is cut off after this long: a stuck database must not hold a search thread (and
# the query behind it) for longer than a first token may take.
DEFAULT_STATEMENT_TIMEOUT_S = 5.0
# A whole search (every stage, the wait for a connection included) is cut off after this long on
# the client, whatever the server does: a silent database must not hold the search thread, and the
# queries queued behind it, for longer than the answer's first token may take. At most half the
# first-token timeout when that is shorter (search_timeout).
DEFAULT_SEARCH_TIMEOUT_S = 10.0
# A read of the whole table (the rows at start, every version for a reconcile): bounded by the
# table's size, not by a search's deadline, on the server and on the client.
BULK_READ_TIMEOUT_S = 300.0
# What every connection asks of libpq unless the DSN says otherwise: a bounded connect, and on TCP
# keepalives (an idle connection to a vanished peer ends after 10 + 3 x 5 s) and a bound on data left
# unacknowledged (tcp_user_timeout, milliseconds). libpq ignores the TCP ones on a Unix socket, where
# the client's deadlines (deadline.py) bound every call.
CONNECTION_BOUNDS = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}
# Connections the service holds at most: a staged search takes two at a time (docs/backends.md).
DEFAULT_POOL_SIZE = 8
# pgvector's index methods a search is staged on, and the setting that widens a query on each:
# more IVFFlat lists probed, or a wider HNSW candidate list (docs/backends.md).
INDEX_METHODS = {"ivfflat": "ivfflat.probes", "hnsw": "hnsw.ef_search"}
# An HNSW table's final hnsw.ef_search unless told: specrag's own HNSW default (IndexConfig).
DEFAULT_HNSW_EF_SEARCH = 128
# pgvector's operator classes by the metric they rank with, and the operator each one orders by.
METRICS = {
    "ip": ("vector_ip_ops", "<#>"),
    "cosine": ("vector_cosine_ops", "<=>"),
    "l2": ("vector_l2_ops", "<->"),
}


class StageQueries(enum.StrEnum):
    """Which stages of the plan a search queries
    (:func:`~specrag.retrieval.backends.pgvector.queries.stage_probes`).

    A stage is a whole query that re-scans the lists of the one before, so every stage between
    the first and the final costs its full share again and only gives a later chance to correct
    a stale speculation: ``ends`` queries the plan's first stage (where speculation starts) and
    its final one, ``every`` each stage of the plan.
    """

    ENDS = "ends"
    EVERY = "every"


class LexicalChannel(enum.StrEnum):
    """What ranks a table's rows by a query's words for hybrid search: PostgreSQL's full-text
    search in the vector stages' snapshot (:mod:`~specrag.retrieval.backends.pgvector.fulltext`), or
    specrag's BM25 over the texts read at start."""

    FTS = "fts"
    BM25 = "bm25"


# The channel that measured better on bench.retrieval's sets (docs/backends.md, "Hybrid").
DEFAULT_LEXICAL = LexicalChannel.BM25


class StageMode(enum.StrEnum):
    """How the stages of one search share connections
    (:mod:`~specrag.retrieval.backends.pgvector.searcher`)."""

    PARALLEL = "parallel"
    SEQUENTIAL = "sequential"


# With only the first and the final stage queried (StageQueries.ENDS), the final query on one
# connection waits for the first stage alone, a small share of the probes; two connections cost
# it the export's wait and a second query competing for the cores (docs/backends.md measures both).
DEFAULT_STAGE_MODE = StageMode.SEQUENTIAL


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


@dataclass(frozen=True)
class Columns:
    """The table's columns holding each passage's id, title, text and embedding."""

    id: str = "id"
    title: str = "title"
    text: str = "text"
    embedding: str = "embedding"

    def __post_init__(self) -> None:
        for name in fields(self):
            value = getattr(self, name.name)
            if not _IDENTIFIER.match(value):
                raise InvalidInputError(f"--pg-columns: {name.name}={value!r} is not a plain column name")

    @classmethod
    def parse(cls, spec: str | None) -> Columns:
        """``id=doc_id,embedding=vec`` (the ones not named keep their defaults)."""
        if not spec:
            return cls()
        known = {item.name for item in fields(cls)}
        chosen: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in known or not value:
                raise InvalidInputError(
                    f"--pg-columns: expected ROLE=COLUMN with ROLE one of {', '.join(sorted(known))}, "
                    f"got {part.strip()!r}"
                )
            chosen[key] = value.strip()
        return cls(**chosen)


def _table_parts(table: str) -> tuple[str, ...]:
    parts = tuple(table.split("."))
    if not 1 <= len(parts) <= 2 or not all(_IDENTIFIER.match(part) for part in parts):
        raise InvalidInputError(f"--pg-table: {table!r} is not TABLE or SCHEMA.TABLE")
    return parts


@dataclass(frozen=True)
class PgSettings:
    """A table to search and how: connection string, table, columns, limits."""

    dsn: str = field(repr=False)
    table: str = "specrag_passages"
    columns: Columns = field(default_factory=Columns)
    statement_timeout_s: float = DEFAULT_STATEMENT_TIMEOUT_S
    pool_size: int = DEFAULT_POOL_SIZE
    #: The client's bound on one search, and on any other call of the service's (a write, a read
    #: of changed rows); reads of the whole table get :data:`BULK_READ_TIMEOUT_S`.
    search_timeout_s: float = DEFAULT_SEARCH_TIMEOUT_S

    def __post_init__(self) -> None:
        _table_parts(self.table)
        for flag, value in (
            ("--pg-statement-timeout", self.statement_timeout_s),
            ("--pg-search-timeout", self.search_timeout_s),
        ):
            if not value > 0:
                raise InvalidInputError(f"{flag} must be positive, got {value}")
        if self.pool_size < 2:
            raise InvalidInputError(
                f"--pg-pool-size must be at least 2 (a staged search takes two), got {self.pool_size}"
            )

    @property
    def table_parts(self) -> tuple[str, ...]:
        """The table's name as (schema, table) or (table,), for ``psycopg.sql.Identifier``."""
        return _table_parts(self.table)

    @property
    def conninfo(self) -> str:
        """The DSN with :func:`bounded_conninfo`'s bounds and the statement timeout."""
        return bounded_conninfo(self.dsn, self.statement_timeout_s)

    @property
    def where(self) -> str:
        """The server and table, for messages: never the password."""
        return f"table {self.table} on {describe_dsn(self.dsn)}"


def resolve_dsn(flag: str | None) -> str:
    """The DSN from ``--pg-dsn``, else from ``$SPECRAG_PG_DSN``."""
    dsn = flag or os.environ.get(DSN_ENV)
    if not dsn:
        raise InvalidInputError(f"--backend pgvector needs --pg-dsn DSN or ${DSN_ENV}")
    return dsn


def search_timeout(given: float | None, first_token_timeout_s: float | None) -> float:
    """The search deadline: ``--pg-search-timeout`` when given, which must be below the first-token
    timeout (a search that outlived it would leave the answer no time), else the default or half
    the first-token timeout, whichever is shorter."""
    if given is None:
        if first_token_timeout_s is None:
            return DEFAULT_SEARCH_TIMEOUT_S
        return min(DEFAULT_SEARCH_TIMEOUT_S, first_token_timeout_s / 2)
    if first_token_timeout_s is not None and given >= first_token_timeout_s:
        raise InvalidInputError(
            f"--pg-search-timeout {given:g} must be below --first-token-timeout {first_token_timeout_s:g}: "
            "a search that took longer would leave the answer no time for its first token"
        )
    return given


def bounded_conninfo(dsn: str, statement_timeout_s: float | None = None) -> str:
    """``dsn`` with :data:`CONNECTION_BOUNDS` where it sets none of its own, and the server's
    ``statement_timeout`` among its ``options`` (set at connect: no round trip of its own)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        given = conninfo_to_dict(dsn)
    except Exception:
        return dsn  # psycopg's own connect names what does not parse
    extra: dict[str, str] = {key: value for key, value in CONNECTION_BOUNDS.items() if key not in given}
    if statement_timeout_s is not None:
        options = str(given.get("options") or "")
        extra["options"] = f"{options} -c statement_timeout={int(statement_timeout_s * 1000)}".strip()
    return make_conninfo(dsn, **extra)


def describe_dsn(dsn: str) -> str:
    """ "host H port P database D user U" for the parts the DSN names; never its password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(dsn)
    except Exception:
        return "a server (the DSN does not parse)"
    named = [
        f"{label} {parts[key]}"
        for key, label in (("host", "host"), ("port", "port"), ("dbname", "database"), ("user", "user"))
        if parts.get(key)
    ]
    return " ".join(named) or "the default local server"


def scrub(text: str, dsn: str) -> str:
    """``text`` with the DSN and its password (if any) replaced by ``***``."""
    from psycopg.conninfo import conninfo_to_dict

    secrets = [dsn]
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:
        password = None
    if password:
        secrets.append(str(password))
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


# Why the documents API is off when the service may not write the table (its routes answer 501).
DOCUMENTS_OFF = (
    "the documents API cannot write to this pgvector table: change the table's rows with your own "
    "writer and restart the service (it reads the rows at start)"
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
    embedder: EmbedderChoice
    """What embeds questions: the model that embedded the table."""


def store_name(settings: PgSettings) -> str:
    """A directory name for the table's document store: its table and a digest of where it is,
    so that two servers' tables of one name keep two stores (never the password)."""
    digest = hashlib.sha256(f"{describe_dsn(settings.dsn)}|{settings.table}".encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", settings.table)
    return f"pgvector-{safe}-{digest}"
