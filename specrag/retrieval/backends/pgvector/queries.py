"""One stage of a pgvector search: its transaction's statements, its query, and its top-k.

A stage is one round trip: its transaction's opening statements (on its first stage), its
setting (``ivfflat.probes``, or ``hnsw.ef_search`` on an HNSW table), its query (prepared once a
connection) and, on the last, the COMMIT go as one pipeline, so no statement waits for the one
before. Every stage reads one ``REPEATABLE READ`` snapshot, so a writer committing meanwhile
cannot make a later stage disagree with an earlier one.

A row another writer committed that the service does not show yet (:mod:`rows`) stands for no row
of the top-k. So a query asks for more rows than k (:func:`fetched`); when the ones it skips still
leave fewer than k with the limit reached, it asks again, the limit doubled, until k rows are shown
or the index has no more: in the stage's own transaction while it is open, in a transaction of
its own after a pipeline that ended with its COMMIT (the final stage's: the rows it adds are
then read in a newer snapshot, shown as the versions the search's visibility holds).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.config import INDEX_METHODS, METRICS, PgSettings, StageQueries
from specrag.retrieval.backends.pgvector.fulltext import fulltext_query
from specrag.retrieval.backends.pgvector.rows import RowNames
from specrag.retrieval.backends.pgvector.table import TableLayout
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import DEFAULT_STAGES, Schedule, StagePlan

__all__ = [
    "MAX_EF_SEARCH",
    "Found",
    "StagedQuery",
    "TableSearch",
    "Words",
    "export",
    "fetched",
    "opening",
    "stage_probes",
    "transaction",
]

_PAD_SCORE = -np.finfo(np.float32).max
# A stage's (scores, rows) and, when its query carried the texts, its full-text ranking of rows.
Found = tuple[np.ndarray, np.ndarray, np.ndarray | None]
# pgvector's largest hnsw.ef_search.
MAX_EF_SEARCH = 1000
# The most rows a query reading past unshown ones asks for on an IVFFlat table (it stops sooner
# once the probed lists have no more).
_MAX_LIMIT = 1 << 20


def stage_probes(plan: StagePlan, probes: int, queried: StageQueries = StageQueries.ENDS) -> list[int]:
    """Each stage's ``ivfflat.probes``, strictly growing, the last ``probes``: the plan's share of
    the work per stage, every stage's or only the first and the last (``queried``). A time-budget
    plan is cut as the IVF kind's default count (a database query cannot be stopped at a time and
    resumed)."""
    if plan.stage_budget_s is not None:
        plan = StagePlan(DEFAULT_STAGES["ivf"], Schedule.GEOMETRIC)
    chosen: list[int] = []
    for stage in range(1, plan.num_stages + 1):
        count = probes if stage == plan.num_stages else max(1, math.floor(probes * plan.done_fraction(stage)))
        if not chosen or count > chosen[-1]:
            chosen.append(min(count, probes))
    if queried is StageQueries.ENDS:
        return sorted({chosen[0], chosen[-1]})
    return chosen


def fetched(k: int) -> int:
    """The rows a query asks for to give a top-k: k and as many more, for the rows it may skip."""
    return 2 * k


@dataclass(frozen=True)
class Words:
    """What a full-text ranking runs on: one text per query, and how many rows it ranks."""

    texts: Sequence[str]
    depth: int


@dataclass(frozen=True)
class StagedQuery:
    """A staged search's queries: their vectors, k, each stage's probes, the visibility the rows
    are shown by, and the words of the full-text ranking (None: none)."""

    matrix: np.ndarray
    k: int
    probes: list[int]
    visibility: Visibility | None
    words: Words | None


def opening(connection: psycopg.Connection, imported: str | None = None) -> list[str]:
    """The statements that open a stage's read-only REPEATABLE READ transaction, on the snapshot
    ``imported`` when given. They are sent in the pipeline of the transaction's first query (or
    export), not in a round trip of their own: no statement waits for the one before."""
    statements = ["BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"]
    if imported is not None:
        statements.append(
            sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(imported)).as_string(connection)
        )
    # Every stage must scan the IVFFlat index: a sequential scan (exact) in one stage and an
    # index scan in another would not nest.
    statements.append("SET LOCAL enable_seqscan = off")
    return statements


@contextlib.contextmanager
def transaction(connection: psycopg.Connection) -> Iterator[None]:
    """Ends whatever transaction the statements inside left open; a pipeline that ended with its
    own COMMIT (a one-shot query's, a last stage's) leaves none, and costs no round trip more.

    A read-only transaction ends with COMMIT, not ROLLBACK: it changed nothing either way, but
    psycopg forgets its prepared statements at every ROLLBACK (and deallocates them in a round
    trip of its own), so the search query would be planned anew every search."""
    try:
        yield
    finally:
        if not connection.broken and connection.info.transaction_status != TransactionStatus.IDLE:
            connection.execute("COMMIT")


def export(connection: psycopg.Connection) -> str:
    """Open the transaction and export its snapshot, in one round trip; returns the snapshot's name."""
    with connection.pipeline():
        for statement in opening(connection):
            connection.execute(statement)
        exported = connection.execute("SELECT pg_export_snapshot()")
    row = exported.fetchone()
    assert row is not None
    return str(row[0])


class TableSearch:
    """The statements of a table's stages, and what a stage's rows are as the service shows them."""

    def __init__(
        self,
        settings: PgSettings,
        layout: TableLayout,
        names: RowNames,
        version_column: str | None,
        fulltext: bool,
    ) -> None:
        self.layout = layout
        self.names = names
        self._widen = INDEX_METHODS[layout.method]
        columns, operator = settings.columns, METRICS[layout.metric][1]
        version = sql.SQL("1") if version_column is None else sql.Identifier(version_column)
        self._fulltext = fulltext_query(settings, version) if fulltext else None
        self._query = sql.SQL(
            "SELECT {id}::text, {ver}, {emb} {op} %(q)s FROM {table} ORDER BY {emb} {op} %(q)s LIMIT %(k)s"
        ).format(
            ver=version,
            id=sql.Identifier(columns.id),
            emb=sql.Identifier(columns.embedding),
            op=sql.SQL(operator),
            table=sql.Identifier(*settings.table_parts),
        )

    def _score(self, raw: float) -> float:
        metric = self.layout.metric
        if metric == "ip":
            return -raw
        if metric == "cosine":
            return 1.0 - raw
        return -raw * raw

    def _widening(self, probes: int, limit: int) -> str:
        # HNSW returns at most ef_search rows: a stage's candidate list is never narrower than its limit.
        hnsw = self.layout.method == "hnsw"
        width = min(MAX_EF_SEARCH, max(probes, limit)) if hnsw else probes
        return f"SET LOCAL {self._widen} = {int(width)}"

    def run(
        self,
        connection: psycopg.Connection,
        matrix: np.ndarray,
        k: int,
        probes: int,
        visibility: Visibility | None = None,
        statements: Sequence[str] = (),
        last: bool = False,
        words: Words | None = None,
    ) -> Found:
        """(scores, rows) of every query at ``probes``, in the caller's transaction (which
        ``statements`` opens, and which ends here when ``last``), and given ``words``, each query's
        full-text ranking of rows in the same transaction (else None); rows ``visibility`` hides
        are skipped (a version replaced since the search began)."""
        shown = None if visibility is None else visibility.row_to_passage
        ids = np.full((len(matrix), k), -1, dtype=np.int64)
        scores = np.full((len(matrix), k), _PAD_SCORE, dtype=np.float32)
        limit = fetched(k)
        # One round trip for the transaction's opening, the setting, every query and the end:
        # a pipeline sends them all at once. The query is prepared from its first run, so the
        # server plans it once a connection.
        with connection.pipeline():
            for statement in statements:
                connection.execute(statement)
            connection.execute(self._widening(probes, limit))
            cursors = [
                connection.execute(self._query, {"q": vector, "k": limit}, prepare=True) for vector in matrix
            ]
            ranked = [] if words is None else self._rank_words(connection, words)
            if last:
                connection.execute("COMMIT")
        for position, cursor in enumerate(cursors):
            records = cursor.fetchall()
            found = list(self.names.shown_records(records, shown))[:k]
            if len(found) < k and len(records) == limit:
                found = self._read_past(connection, matrix[position], k, probes, limit, shown, last)
            for slot, (row, (raw,)) in enumerate(found):
                ids[position, slot], scores[position, slot] = row, self._score(float(raw))
        if words is None:
            return scores, ids, None
        lexical = np.full((len(matrix), words.depth), -1, dtype=np.int64)
        for position, cursor in enumerate(ranked):
            for slot, (row, _) in enumerate(self.names.shown_records(cursor.fetchall(), shown)):
                lexical[position, slot] = row
        return scores, ids, lexical

    def _read_past(
        self,
        connection: psycopg.Connection,
        vector: np.ndarray,
        k: int,
        probes: int,
        limit: int,
        shown: np.ndarray | None,
        committed: bool,
    ) -> list[tuple[int, list[Any]]]:
        """The top-k of one query whose first read held too many rows the service does not show:
        read again, the limit doubled each time, until k are shown or the index has no more rows
        to give; in a transaction of its own when the stage's has ``committed``."""
        cap = MAX_EF_SEARCH if self.layout.method == "hnsw" else _MAX_LIMIT
        while True:
            limit = min(2 * limit, cap)
            with connection.pipeline():
                for statement in opening(connection) if committed else ():
                    connection.execute(statement)
                connection.execute(self._widening(probes, limit))
                cursor = connection.execute(self._query, {"q": vector, "k": limit}, prepare=True)
                if committed:
                    connection.execute("COMMIT")
            records = cursor.fetchall()
            found = list(self.names.shown_records(records, shown))[:k]
            if len(found) >= k or len(records) < limit or limit >= cap:
                return found

    def _rank_words(self, connection: psycopg.Connection, words: Words) -> list[psycopg.Cursor[Any]]:
        """Send each text's full-text query into the pipeline open on ``connection``."""
        if self._fulltext is None:
            raise InvalidInputError("this pgvector index was opened without its full-text channel")
        return [
            connection.execute(self._fulltext, {"t": text, "n": words.depth}, prepare=True)
            for text in words.texts
        ]
