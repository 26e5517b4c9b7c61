"""PostgreSQL's full-text search as the lexical channel of a pgvector table.

The table's own rows are ranked by the words of a query, in the same transaction (so the same
snapshot) as the vector stages: a row written after the search began, or not yet committed, is
in neither channel, and a replaced version is in both or neither. specrag's BM25 instead ranks
the texts read at start and those the documents API added since, which another writer's rows
never reach.

The table holds a stored generated ``tsvector`` column over its title and text (English
stemming and stop words, as BM25's analyser) with a GIN index: ``index build --backend pgvector``
adds both, and a user's own table needs them added once (:func:`fulltext_statements` says how;
``serve --pg-lexical fts`` refuses a table without the column, printing them).

A question is a few words, few of which a passage holds all of, so its terms are OR-ed (as BM25
scores any term found), not AND-ed as ``plainto_tsquery`` would; ``ts_rank`` orders the rows
that hold any, best first.
"""

from __future__ import annotations

from psycopg import sql

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.config import PgSettings
from specrag.retrieval.backends.pgvector.database import Database

__all__ = ["FULLTEXT_COLUMN", "check_fulltext", "fulltext_query", "fulltext_statements"]

# The generated tsvector column specrag searches (and index build creates).
FULLTEXT_COLUMN = "specrag_fts"
_CONFIGURATION = "english"


def fulltext_statements(settings: PgSettings) -> list[sql.Composed]:
    """The statements that give the table its tsvector column and the column's GIN index."""
    columns, table = settings.columns, sql.Identifier(*settings.table_parts)
    return [
        sql.SQL(
            "ALTER TABLE {table} ADD COLUMN {fts} tsvector GENERATED ALWAYS AS "
            "(to_tsvector({config}, coalesce({title}, '') || ' ' || coalesce({text}, ''))) STORED"
        ).format(
            table=table,
            fts=sql.Identifier(FULLTEXT_COLUMN),
            config=sql.Literal(_CONFIGURATION),
            title=sql.Identifier(columns.title),
            text=sql.Identifier(columns.text),
        ),
        sql.SQL("CREATE INDEX {name} ON {table} USING gin ({fts})").format(
            name=sql.Identifier(f"{settings.table_parts[-1]}_{FULLTEXT_COLUMN}_gin"),
            table=table,
            fts=sql.Identifier(FULLTEXT_COLUMN),
        ),
    ]


def check_fulltext(database: Database) -> None:
    """Refuse (InvalidInputError, exit 2) a table without the tsvector column, saying how to add it."""
    settings = database.settings
    with database.connection() as connection:
        found = connection.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
            (sql.Identifier(*settings.table_parts).as_string(connection), FULLTEXT_COLUMN),
        ).fetchone()
        if found is not None and found[0] == "tsvector":
            return
        statements = "; ".join(statement.as_string(connection) for statement in fulltext_statements(settings))
    raise InvalidInputError(
        f"--pg-lexical fts: {settings.table} has no tsvector column {FULLTEXT_COLUMN!r}: add it with "
        f"{statements}; or serve with --pg-lexical bm25"
    )


def fulltext_query(settings: PgSettings, version: sql.Composable) -> sql.Composed:
    """A query's ranked rows as (id, ``version``), best first; parameters ``t`` (the query's
    text) and ``n`` (how many)."""
    return sql.SQL(
        "SELECT {id}::text, {ver} FROM {table}, "
        "to_tsquery({config}, replace(plainto_tsquery({config}, %(t)s)::text, ' & ', ' | ')) AS q "
        "WHERE {fts} @@ q ORDER BY ts_rank({fts}, q) DESC, {id} LIMIT %(n)s"
    ).format(
        id=sql.Identifier(settings.columns.id),
        ver=version,
        table=sql.Identifier(*settings.table_parts),
        config=sql.Literal(_CONFIGURATION),
        fts=sql.Identifier(FULLTEXT_COLUMN),
    )
