"""Loading a corpus into a table with a vector index, and checking a table before serving it.

A table specrag builds holds each passage's id, title, text and embedding (specrag's embedder's
vectors) with a tsvector of its words (:mod:`~specrag.retrieval.backends.pgvector.fulltext`), and an
IVFFlat index with as many lists as specrag's own IVF build would train
(:func:`~specrag.retrieval.backends.local.staged_ivf.choose_nlist`), so the two backends are compared at the
same list count, or (``--pg-index hnsw``) an HNSW index with pgvector's default graph settings. A
user's existing table is searched as it is: :func:`inspect_table` reads its columns and its
vector index and refuses (``InvalidInputError``, exit 2) what cannot be searched in stages,
naming the column.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import psycopg
from psycopg import sql
from tqdm import tqdm

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import DEFAULT_NLIST, choose_nlist
from specrag.retrieval.backends.pgvector.config import BULK_READ_TIMEOUT_S, INDEX_METHODS, METRICS, PgSettings
from specrag.retrieval.backends.pgvector.database import Database, connect_once
from specrag.retrieval.backends.pgvector.deadline import Deadline
from specrag.retrieval.backends.pgvector.fulltext import fulltext_statements
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN
from specrag.retrieval.corpus import Passage

__all__ = [
    "TableLayout",
    "bulk_read",
    "inspect_table",
    "load_table",
    "read_passages",
    "read_rows",
    "regclass_name",
]

_COPY_CHUNK = 2000


@dataclass(frozen=True)
class TableLayout:
    """What serving a table needs to know of it: its vectors' dimension, the metric of its vector
    index, its method (``ivfflat`` or ``hnsw``) and an IVFFlat index's list count (0 for HNSW)."""

    dim: int
    metric: str
    lists: int
    index_name: str
    method: str = "ivfflat"


def _table(settings: PgSettings) -> sql.Identifier:
    return sql.Identifier(*settings.table_parts)


def regclass_name(settings: PgSettings, connection: psycopg.Connection) -> str:
    """The table's name as ``to_regclass`` reads it: each part quoted, so ``Document`` is
    ``"Document"`` (as the table was created) and not folded to ``document``."""
    return _table(settings).as_string(connection)


def load_table(
    settings: PgSettings,
    passages: Sequence[Passage],
    vectors: np.ndarray,
    *,
    metric: str = "ip",
    nlist: int = DEFAULT_NLIST,
    replace: bool = False,
    progress: bool = False,
    index_method: str = "ivfflat",
) -> TableLayout:
    """Create the table (``replace`` drops one that exists), copy the passages and their vectors in,
    and build the IVFFlat (or HNSW, ``index_method``) index; returns what :func:`inspect_table`
    would read back."""
    if len(passages) != len(vectors) or not len(passages):
        raise InvalidInputError(f"{len(passages)} passages and {len(vectors)} vectors: need as many, not 0")
    if metric not in METRICS:
        raise InvalidInputError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    if index_method not in INDEX_METHODS:
        raise InvalidInputError(f"unknown index {index_method!r}; choose one of {', '.join(INDEX_METHODS)}")
    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    dim = matrix.shape[1]
    columns = settings.columns
    table = _table(settings)
    lists = choose_nlist(len(matrix), nlist)
    with connect_once(settings) as connection:
        if replace:
            connection.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
        connection.execute(
            sql.SQL(
                "CREATE TABLE {} ({} text PRIMARY KEY, {} text NOT NULL, {} text NOT NULL, {} vector({}), "
                "{} bigint NOT NULL DEFAULT 1)"
            ).format(
                table,
                sql.Identifier(columns.id),
                sql.Identifier(columns.title),
                sql.Identifier(columns.text),
                sql.Identifier(columns.embedding),
                sql.Literal(dim),
                sql.Identifier(VERSION_COLUMN),
            )
        )
        copy_sql = sql.SQL("COPY {} ({}, {}, {}, {}) FROM STDIN WITH (FORMAT BINARY)").format(
            table,
            *(sql.Identifier(name) for name in (columns.id, columns.title, columns.text, columns.embedding)),
        )
        with (
            tqdm(total=len(matrix), desc="copying rows", unit="row", disable=not progress) as bar,
            connection.cursor() as cursor,
            cursor.copy(copy_sql) as copy,
        ):
            copy.set_types(["text", "text", "text", "vector"])
            for position, passage in enumerate(passages):
                copy.write_row((passage.id, passage.title, passage.text, matrix[position]))
                if (position + 1) % _COPY_CHUNK == 0:
                    bar.update(_COPY_CHUNK)
            bar.update(len(matrix) % _COPY_CHUNK)
        started = time.perf_counter()
        hnsw = index_method == "hnsw"
        described = "HNSW index" if hnsw else f"IVFFlat index ({lists} lists)"
        if progress:
            print(f"building the {described} ...", flush=True)
        connection.execute("SET maintenance_work_mem = '512MB'")
        for statement in fulltext_statements(settings):  # the lexical channel's (--pg-lexical fts)
            connection.execute(statement)
        index_name = f"{settings.table_parts[-1]}_{columns.embedding}_{index_method}"
        connection.execute(
            sql.SQL("CREATE INDEX {} ON {} USING {} ({} {}){}").format(
                sql.Identifier(index_name),
                table,
                sql.SQL(index_method),
                sql.Identifier(columns.embedding),
                sql.SQL(METRICS[metric][0]),
                sql.SQL("") if hnsw else sql.SQL(" WITH (lists = {})").format(sql.Literal(lists)),
            )
        )
        connection.execute(sql.SQL("ANALYZE {}").format(table))
        connection.commit()
        if progress:
            print(f"built the {described} in {time.perf_counter() - started:.1f}s", flush=True)
    return TableLayout(dim, metric, 0 if hnsw else lists, index_name, index_method)


def inspect_table(
    database: Database, expected_dim: int | None = None, metric: str | None = None, method: str | None = None
) -> TableLayout:
    """Check that the table has the columns named, that the embedding column is a ``vector`` of
    ``expected_dim`` (the query embedder's) with an IVFFlat or HNSW index (of ``method`` and
    ``metric``, when given; IVFFlat first when it has both): ``InvalidInputError`` naming the
    column otherwise."""
    settings = database.settings
    columns = settings.columns
    with database.connection() as connection:
        oid = connection.execute(
            "SELECT to_regclass(%s)::oid", (regclass_name(settings, connection),)
        ).fetchone()
        if oid is None or oid[0] is None:
            raise InvalidInputError(f"no {settings.where}")
        types = dict(
            connection.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
                (oid[0],),
            ).fetchall()
        )
        for role in ("id", "title", "text", "embedding"):
            name = getattr(columns, role)
            if name not in types:
                raise InvalidInputError(
                    f"column {name!r} ({role}) is not in {settings.table}: it has "
                    f"{', '.join(sorted(types))}; map it with --pg-columns"
                )
        kind = types[columns.embedding]
        if not kind.startswith("vector("):
            raise InvalidInputError(
                f"column {columns.embedding!r} of {settings.table} is {kind}, "
                "not a vector(DIM) with its dimension"
            )
        dim = int(kind[len("vector(") : -1])
        if expected_dim is not None and dim != expected_dim:
            raise InvalidInputError(
                f"column {columns.embedding!r} of {settings.table} holds vector({dim}), the query embedder "
                f"gives {expected_dim} dimensions: embed queries with the model that embedded the table"
            )
        indexes = connection.execute(
            "SELECT i.relname, am.amname, opc.opcname, coalesce(array_to_string(i.reloptions, ','), '') "
            "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_am am ON am.oid = i.relam "
            "JOIN pg_opclass opc ON opc.oid = x.indclass[0] JOIN pg_attribute a "
            "ON a.attrelid = x.indrelid AND a.attnum = x.indkey[0] WHERE x.indrelid = %s AND a.attname = %s",
            (oid[0], columns.embedding),
        ).fetchall()
    staged = sorted(
        (row for row in indexes if row[1] in INDEX_METHODS and method in (None, row[1])),
        key=lambda row: list(INDEX_METHODS).index(row[1]),
    )
    if not staged:
        found = ", ".join(f"{name} ({kind})" for name, kind, _, _ in indexes) or "none"
        wanted = method or "IVFFlat or HNSW"
        raise InvalidInputError(
            f"column {columns.embedding!r} of {settings.table} has no {wanted} index (found: {found}): "
            f"CREATE INDEX ... USING {method or 'ivfflat'}, or build the table with --pg-index"
        )
    name, found_method, opclass, options = staged[0]
    found_metric = next((key for key, (ops, _) in METRICS.items() if ops == opclass), None)
    if found_metric is None:
        raise InvalidInputError(
            f"column {columns.embedding!r}: {found_method} operator class {opclass} is not supported"
        )
    if metric is not None and metric != found_metric:
        raise InvalidInputError(
            f"column {columns.embedding!r} of {settings.table} is indexed for {found_metric} ({opclass}), "
            f"not {metric}"
        )
    if found_method == "hnsw":
        return TableLayout(dim, found_metric, 0, name, found_method)
    lists = next((int(part.split("=")[1]) for part in options.split(",") if part.startswith("lists=")), 100)
    return TableLayout(dim, found_metric, lists, name, found_method)


@contextlib.contextmanager
def bulk_read(database: Database) -> Iterator[psycopg.Connection]:
    """A connection for a read of the whole table: bounded by :data:`BULK_READ_TIMEOUT_S` on the
    server and on the client, not by a search's limits."""
    bound = int(BULK_READ_TIMEOUT_S * 1000)
    with database.connection(Deadline.after(BULK_READ_TIMEOUT_S + 5)) as connection:
        connection.execute(f"SET statement_timeout = {bound}")
        try:
            yield connection
        finally:
            if not connection.broken:
                connection.execute(
                    f"SET statement_timeout = {int(database.settings.statement_timeout_s * 1000)}"
                )


def read_passages(database: Database) -> list[Passage]:
    """Every row's id, title and text, in the order that numbers the rows for the searcher (ids
    sorted bytewise), so row i of a search is ``passages[i]``."""
    return read_rows(database)[0]


def read_rows(database: Database, version_column: str | None = None) -> tuple[list[Passage], list[int]]:
    """:func:`read_passages` and each row's version (``version_column``; None: 1 each), read
    together in one statement, so a row's text and version are of one version."""
    settings = database.settings
    columns = settings.columns
    query = sql.SQL(
        "SELECT {}::text, coalesce({}::text, ''), {}::text, {} FROM {} ORDER BY {}::text COLLATE \"C\""
    ).format(
        sql.Identifier(columns.id),
        sql.Identifier(columns.title),
        sql.Identifier(columns.text),
        sql.SQL("1") if version_column is None else sql.Identifier(version_column),
        _table(settings),
        sql.Identifier(columns.id),
    )
    with bulk_read(database) as connection:
        rows = connection.execute(query).fetchall()
    if not rows:
        raise InvalidInputError(f"{settings.table} has no rows")
    passages = [Passage(id=row[0], title=row[1], text=row[2] or "") for row in rows]
    return passages, [int(row[3]) for row in rows]
