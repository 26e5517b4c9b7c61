"""The documents API's writes to a pgvector table: one transaction a request, with each row's version.

The table is the durable record of a corpus served from it, so a write is answered only after its
COMMIT. Each row carries a version (:data:`VERSION_COLUMN`, a ``bigint`` the backend adds, 1 for
the rows that were there): the searcher names a row by its id *and* version, so a search whose
snapshot predates a replacement still finds the version it read, and one after it the new one,
never the one under the other's row. A write names the version it replaces; a row whose version
in the table is not that one was changed by another writer meanwhile, and the write is refused
(:class:`~specrag.errors.ConflictError`, HTTP 409) instead of overwriting it unseen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import psycopg
from psycopg import sql

from specrag.errors import ConflictError
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.corpus import Passage

__all__ = ["VERSION_COLUMN", "RowWrite", "TableWriter", "add_version_column"]

# The column that numbers each row's versions; every row the table had before it was added is 1.
VERSION_COLUMN = "specrag_version"


def add_version_column(database: Database) -> str | None:
    """Add :data:`VERSION_COLUMN` to the table unless it has it; returns why it could not (the
    documents API is then off, saying so), None when the table has it.

    A constant default is stored in the catalogue, not in each row, so adding the column to a large
    table does not rewrite it (PostgreSQL 11 and later).
    """
    settings = database.settings
    statement = sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} bigint NOT NULL DEFAULT 1").format(
        sql.Identifier(*settings.table_parts), sql.Identifier(VERSION_COLUMN)
    )
    try:
        with database.connection() as connection:
            connection.execute(statement)
    except psycopg.errors.InsufficientPrivilege:
        return (
            f"the documents API writes to {settings.table} with a {VERSION_COLUMN} column, and this user "
            f"may not add it: ALTER TABLE {settings.table} ADD COLUMN {VERSION_COLUMN} bigint NOT NULL "
            "DEFAULT 1 as the table's owner, or change its rows with your own writer"
        )
    return None


@dataclass(frozen=True)
class RowWrite:
    """One row to write: the passage and its vector at ``version``, replacing ``replaces`` (None:
    the id has no row in the table)."""

    passage: Passage
    vector: np.ndarray
    version: int
    replaces: int | None


@contextlib.contextmanager
def _conflicts() -> Iterator[None]:
    """A row inserted by another writer between this write's check and its INSERT: a conflict
    (HTTP 409, retry once the service has noticed the row), not the database's failure."""
    try:
        yield
    except psycopg.errors.UniqueViolation:
        raise ConflictError(
            "another writer inserted a document of this id meanwhile: retry once the service has noticed it"
        ) from None


class TableWriter:
    """Writes and deletes rows of the served table, each request in one transaction."""

    def __init__(self, database: Database) -> None:
        self.database = database
        settings = database.settings
        columns = settings.columns
        names = {
            "table": sql.Identifier(*settings.table_parts),
            "id": sql.Identifier(columns.id),
            "title": sql.Identifier(columns.title),
            "text": sql.Identifier(columns.text),
            "emb": sql.Identifier(columns.embedding),
            "ver": sql.Identifier(VERSION_COLUMN),
        }
        # The id goes as an untyped parameter: the server casts it to the id column's own type.
        self._held = sql.SQL("SELECT {ver} FROM {table} WHERE {id} = %s FOR UPDATE").format(**names)
        self._update = sql.SQL(
            "UPDATE {table} SET {title} = %s, {text} = %s, {emb} = %s, {ver} = %s WHERE {id} = %s"
        ).format(**names)
        self._insert = sql.SQL(
            "INSERT INTO {table} ({id}, {title}, {text}, {emb}, {ver}) VALUES (%s, %s, %s, %s, %s)"
        ).format(**names)
        self._delete = sql.SQL("DELETE FROM {table} WHERE {id} = %s").format(**names)
        self._reembed = sql.SQL(
            "UPDATE {table} SET {emb} = %s, {ver} = %s WHERE {id} = %s AND {ver} = %s"
        ).format(**names)

    def _check_held(self, connection: psycopg.Connection, passage_id: str, expected: int | None) -> None:
        """ConflictError unless the table holds ``passage_id`` at ``expected`` (None: no row),
        the row locked until the transaction ends."""
        found = connection.execute(self._held, (passage_id,)).fetchone()
        held = None if found is None else int(found[0])
        if held != expected:
            raise ConflictError(
                f"document {passage_id!r} was changed in {self.database.settings.table} by another "
                f"writer (version {held}, this service holds {expected}): retry once it has noticed"
            )

    def write(self, rows: Sequence[RowWrite], deleted: Sequence[tuple[str, int]] = ()) -> None:
        """Write ``rows`` and delete the ids of ``deleted`` (id, the version held) in one
        transaction, committed when this returns; ConflictError (nothing written) when one of them
        is not at the version it replaces."""
        with self.database.connection() as connection, _conflicts(), connection.transaction():
            for row in rows:
                passage = row.passage
                self._check_held(connection, passage.id, row.replaces)
                vector = np.asarray(row.vector, dtype=np.float32)
                if row.replaces is None:
                    connection.execute(
                        self._insert, (passage.id, passage.title, passage.text, vector, row.version)
                    )
                else:
                    connection.execute(
                        self._update, (passage.title, passage.text, vector, row.version, passage.id)
                    )
            for passage_id, version in deleted:
                self._check_held(connection, passage_id, version)
                connection.execute(self._delete, (passage_id,))

    def reembed(self, rows: Sequence[tuple[str, int, np.ndarray]]) -> set[str]:
        """Write each (id, version, vector) of ``rows`` as the row's embedding and its next version,
        in one transaction of its own; returns the ids written (a row changed again meanwhile is
        left to that change's own notification)."""
        written: set[str] = set()
        with self.database.connection() as connection, connection.transaction():
            for passage_id, version, vector in rows:
                cursor = connection.execute(
                    self._reembed, (np.asarray(vector, dtype=np.float32), version + 1, passage_id, version)
                )
                if cursor.rowcount:
                    written.add(passage_id)
        return written
