"""Staged search of a pgvector table by nested IVFFlat probes, all stages in one snapshot.

No database streams a running top-k from one query, but IVFFlat probes the ``ivfflat.probes``
lists nearest the query and scores their rows exactly, so a query at more probes scans a superset
of the rows a query at fewer probes scanned: its top-k refines the other's. A stage is therefore
a whole query at the stage's share of the final probes (the stage plan's share, as the
in-process IVF scans that share of its probe list), and the last stage is the one-shot query
itself. Every stage reads one ``REPEATABLE READ`` snapshot, so a writer committing meanwhile
cannot make a later stage disagree with an earlier one.

The stages run as separate queries, each re-scanning the lists of the one before, so a stage
between the first and the final costs its whole share again and only gives a later chance to
correct a stale speculation. By default (``ends``) a search queries the plan's first stage, where
speculation starts, and its final one: their database time is the one-shot query's and the first
stage's share more; ``every`` queries each stage of the plan (the geometric plan's shares sum to
about 2) for a running top-k that refines at each. Run one after the other on one connection
(``sequential``), the final result arrives after all of them; ``parallel`` runs the earlier stages
one after the other on one connection, which exports its snapshot (so the first stage starts at
once), and the final query on a second connection that imports it (so it waits only for the
export, not for the stages), so the final result arrives about when a one-shot query's would on
a table whose query is not dominated by fixed costs (docs/backends.md has the figures). A stage
is one round trip: its transaction's opening statements (on its first stage), its setting, its
query (prepared once a connection) and, on the last, the COMMIT go as one pipeline, so the
final query costs one round trip more than a one-shot query, the export's, and no statement of
it waits for the one before. A stage that arrives after the final one is dropped.

An HNSW table is staged the same way with a growing ``hnsw.ef_search`` (at least k) in place of
the probes. A wider candidate list is not guaranteed to find every row a narrower one found, so
the stages of an HNSW search need not nest; the final stage is still the one-shot query, and on
the tables measured no stage's i-th best was worse than the stage before (docs/backends.md).
pgvector 0.8's iterative scans (``hnsw.iterative_scan``) resume a scan when filtering leaves
fewer rows than the LIMIT; these queries filter nothing, so they change no result here.

With the full-text channel (``--pg-lexical fts``, :meth:`PgVectorSearcher.search_text`,
:meth:`PgVectorSearcher.stages_text`), each query's full-text ranking goes in the pipeline of the
first stage's transaction, and in the ``parallel`` mode of the final stage's too (which may
arrive first): it reads the stages' snapshot and costs no round trip of its own.

Scores are similarities, higher first, as the in-process indexes give for unit vectors: the
inner product (``ip``), 1 - the cosine distance (``cosine``), or minus the squared L2 distance.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from specrag.errors import InvalidInputError
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.pgvector.config import (
    DEFAULT_HNSW_EF_SEARCH,
    DEFAULT_STAGE_MODE,
    INDEX_METHODS,
    METRICS,
    StageMode,
    StageQueries,
)
from specrag.retrieval.pgvector.database import Database, DatabaseUnavailableError
from specrag.retrieval.pgvector.fulltext import fulltext_query
from specrag.retrieval.pgvector.table import TableLayout
from specrag.retrieval.staged_ivf import default_nprobe
from specrag.retrieval.stages import DEFAULT_STAGES, Schedule, StagePlan, StageResult, prepare_queries

__all__ = ["PgVectorSearcher", "stage_probes"]

_PAD_SCORE = -np.finfo(np.float32).max
# A stage's (scores, rows) and, when its query carried the texts, its full-text ranking of rows.
_Found = tuple[np.ndarray, np.ndarray, np.ndarray | None]
# pgvector's largest hnsw.ef_search.
_MAX_EF_SEARCH = 1000


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


@dataclass(frozen=True)
class _Words:
    """What a full-text ranking runs on: one text per query, and how many rows it ranks."""

    texts: Sequence[str]
    depth: int


def _opening(connection: psycopg.Connection, imported: str | None = None) -> list[str]:
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
def _transaction(connection: psycopg.Connection) -> Iterator[None]:
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


def _export(connection: psycopg.Connection) -> str:
    """Open the transaction and export its snapshot, in one round trip; returns the snapshot's name."""
    with connection.pipeline():
        for statement in _opening(connection):
            connection.execute(statement)
        exported = connection.execute("SELECT pg_export_snapshot()")
    row = exported.fetchone()
    assert row is not None
    return str(row[0])


def _visible(row: int, shown: np.ndarray) -> bool:
    """Whether ``shown`` (a visibility's row-to-passage map, padding last) shows ``row``."""
    return row < len(shown) - 1 and bool(shown[row] >= 0)


class PgVectorSearcher:
    """A :class:`~specrag.retrieval.stages.StagedSearcher` over a pgvector table; row ``i`` is the
    ``i``-th of ``row_ids`` (the table's ids as text, read once at start) at ``versions[i]``.

    A row is named by its id and version (``version_column``; None: every row is version 1), so
    that a version the documents API writes gets a row of its own (:meth:`map_rows`), and a
    search whose snapshot still holds the version before finds the row that names it. A key
    found in the table that names no row (another writer's) is skipped.
    """

    kind = "pgvector"
    owner: Any = None  # nothing to save: the table is the index
    #: A search's snapshot may hold versions its visibility does not show yet: it takes the
    #: visibility always, to show the version the visibility does instead (:meth:`_shown_row`).
    snapshot_rows = True

    def __init__(
        self,
        database: Database,
        layout: TableLayout,
        row_ids: Sequence[str],
        nprobe: int | None = None,
        mode: StageMode | str = DEFAULT_STAGE_MODE,
        versions: Sequence[int] | None = None,
        queried: StageQueries | str = StageQueries.ENDS,
        version_column: str | None = None,
        fulltext: bool = False,
    ) -> None:
        self.database = database
        self.layout = layout
        self.mode = StageMode(mode)
        self.queried = StageQueries(queried)
        #: The final stage's ``ivfflat.probes`` (the one-shot query's), as :class:`StagedIVF` names
        #: it; on an HNSW table, its ``hnsw.ef_search``.
        if layout.method == "hnsw":
            self.nprobe = min(_MAX_EF_SEARCH, DEFAULT_HNSW_EF_SEARCH if nprobe is None else nprobe)
        else:
            self.nprobe = min(layout.lists, default_nprobe(layout.lists) if nprobe is None else nprobe)
        self._widen = INDEX_METHODS[layout.method]
        if self.nprobe < 1:
            raise InvalidInputError(f"--nprobe must be at least 1, got {self.nprobe}")
        held = [1] * len(row_ids) if versions is None else list(versions)
        if len(held) != len(row_ids):
            raise InvalidInputError(f"{len(row_ids)} row ids and {len(held)} versions")
        self._row_of = {key: row for row, key in enumerate(zip(row_ids, held, strict=True))}
        # Each id's rows, oldest first (a tuple replaced whole: searches read it while rows are mapped).
        self._rows_of_id: dict[str, tuple[int, ...]] = {}
        for row, row_id in enumerate(row_ids):
            self._rows_of_id[row_id] = (*self._rows_of_id.get(row_id, ()), row)
        self._ntotal = len(row_ids)
        self.version_column = version_column
        #: Why the documents API may not write this table (None: it may), set by whoever opened it.
        self.documents_off: str | None = None
        if version_column is None:
            self.documents_off = "the table has no version column"
        #: Why changes by other writers are not noticed while serving (None: a trigger reports them).
        self.changes_off: str | None = "no change trigger installed"
        #: What to stop before the connections close (a change listener), called by :meth:`close`.
        self.on_close: list[Callable[[], None]] = []
        columns, operator = database.settings.columns, METRICS[layout.metric][1]
        version = sql.SQL("1") if version_column is None else sql.Identifier(version_column)
        #: Whether the index ranks query texts by the table's full-text search (:meth:`search_text`).
        self.ranks_text = fulltext
        self._fulltext = fulltext_query(database.settings, version) if fulltext else None
        self._query = sql.SQL(
            "SELECT {id}::text, {ver}, {emb} {op} %(q)s FROM {table} ORDER BY {emb} {op} %(q)s LIMIT %(k)s"
        ).format(
            ver=version,
            id=sql.Identifier(columns.id),
            emb=sql.Identifier(columns.embedding),
            op=sql.SQL(operator),
            table=sql.Identifier(*database.settings.table_parts),
        )
        # Two threads a search (its final query and its earlier stages), as many searches as the
        # pool has pairs of connections for.
        self._threads = ThreadPoolExecutor(
            max_workers=database.settings.pool_size, thread_name_prefix="pg-stage"
        )

    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def ntotal(self) -> int:
        return self._ntotal

    @property
    def nlist(self) -> int:
        """The IVFFlat index's lists (what a probe share is a share of); 0 on an HNSW table."""
        return self.layout.lists

    @property
    def next_row(self) -> int:
        """The row the next :meth:`map_rows` must start at (a :class:`Growable`'s)."""
        return self._ntotal

    def keys(self) -> list[tuple[str, int]]:
        """Each row's (id, version), in row order; a row whose key was re-mapped names its last."""
        keys: list[tuple[str, int] | None] = [None] * self._ntotal
        for key, row in self._row_of.items():
            keys[row] = key
        return [key for key in keys if key is not None]

    def map_rows(self, keys: Sequence[tuple[str, int]], first_row: int) -> None:
        """Name rows ``first_row``, ``first_row + 1``, ... by the table's (id, version) ``keys``:
        versions committed to the table (by :class:`~specrag.retrieval.pgvector.writes.TableWriter`)
        that searches should find as these rows. The rows of the versions before stay mapped, for
        searches whose snapshot still holds them (the index hides them from newer ones)."""
        if first_row != self._ntotal:
            raise InvalidInputError(f"rows are mapped from row {self._ntotal}, not {first_row}")
        for offset, key in enumerate(keys):
            row_id = str(key[0])
            self._row_of[(row_id, int(key[1]))] = first_row + offset
            self._rows_of_id[row_id] = (*self._rows_of_id.get(row_id, ()), first_row + offset)
        self._ntotal = first_row + len(keys)

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Refused: a table holds its own vectors, and its rows are named by :meth:`map_rows`
        once committed, which the caller does before the index asks for them."""
        raise InvalidInputError(
            f"rows {first_row}.. of a pgvector index are mapped to committed table rows (map_rows), "
            "not added as vectors"
        )

    def compacted(self, keep: np.ndarray) -> PgVectorSearcher:
        """Itself: the table holds only the current versions, there is nothing to drop."""
        return self

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise InvalidInputError("a pgvector table's vectors are not read back into the service")

    @property
    def settings(self) -> dict[str, Any]:
        """What the stage statistics key a search's figures by (never the DSN)."""
        return {
            "kind": self.kind,
            "index": self.layout.method,
            "table": self.database.settings.table,
            "metric": self.layout.metric,
            "lists": self.layout.lists,
            "probes": self.nprobe,
            "stage_mode": str(self.mode),
            "stage_queries": str(self.queried),
            "fulltext": self.ranks_text,
        }

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop()()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.database.close()

    def _score(self, raw: float) -> float:
        metric = self.layout.metric
        if metric == "ip":
            return -raw
        if metric == "cosine":
            return 1.0 - raw
        return -raw * raw

    def _shown_records(
        self, records: list[tuple[Any, ...]], shown: np.ndarray | None
    ) -> Iterator[tuple[int, list[Any]]]:
        """The rows a search shows for records of (id, version, ...), best first, with the rest
        of each record (:meth:`_shown_row`); a record that no shown version stands for, and a
        second record for a row already given (a version and its stand-in), are skipped."""
        taken: set[int] = set()
        for row_id, version, *rest in records:
            row = self._shown_row(row_id, int(version), shown)
            if row is None or row in taken:
                continue
            taken.add(row)
            yield row, rest

    def _run(
        self,
        connection: psycopg.Connection,
        matrix: np.ndarray,
        k: int,
        probes: int,
        visibility: Visibility | None = None,
        opening: Sequence[str] = (),
        last: bool = False,
        words: _Words | None = None,
    ) -> _Found:
        """(scores, rows) of every query at ``probes``, in the caller's transaction (which
        ``opening`` opens, and which ends here when ``last``), and given ``words``, each query's
        full-text ranking of rows in the same transaction (else None); rows ``visibility`` hides
        are skipped (a version replaced since the search began)."""
        shown = None if visibility is None else visibility.row_to_passage
        ids = np.full((len(matrix), k), -1, dtype=np.int64)
        scores = np.full((len(matrix), k), _PAD_SCORE, dtype=np.float32)
        # One round trip for the transaction's opening, the setting, every query and the end:
        # a pipeline sends them all at once. The query is prepared from its first run, so the
        # server plans it once a connection.
        with connection.pipeline():
            for statement in opening:
                connection.execute(statement)
            # HNSW returns at most ef_search rows: a stage's candidate list is never narrower than k.
            width = max(probes, k) if self.layout.method == "hnsw" else probes
            connection.execute(f"SET LOCAL {self._widen} = {int(width)}")
            cursors = [
                connection.execute(self._query, {"q": vector, "k": k}, prepare=True) for vector in matrix
            ]
            ranked = [] if words is None else self._rank_words(connection, words)
            if last:
                connection.execute("COMMIT")
        for position, cursor in enumerate(cursors):
            for slot, (row, (raw,)) in enumerate(self._shown_records(cursor.fetchall(), shown)):
                ids[position, slot], scores[position, slot] = row, self._score(float(raw))
        if words is None:
            return scores, ids, None
        lexical = np.full((len(matrix), words.depth), -1, dtype=np.int64)
        for position, cursor in enumerate(ranked):
            for slot, (row, _) in enumerate(self._shown_records(cursor.fetchall(), shown)):
                lexical[position, slot] = row
        return scores, ids, lexical

    def _rank_words(self, connection: psycopg.Connection, words: _Words) -> list[psycopg.Cursor[Any]]:
        """Send each text's full-text query into the pipeline open on ``connection``."""
        if self._fulltext is None:
            raise InvalidInputError("this pgvector index was opened without its full-text channel")
        return [
            connection.execute(self._fulltext, {"t": text, "n": words.depth}, prepare=True)
            for text in words.texts
        ]

    def _shown_row(self, row_id: str, version: int, shown: np.ndarray | None) -> int | None:
        """The row a search shows for the table's (id, version) in its snapshot: that version's
        row, or, where the search's visibility does not show it (committed after the visibility
        was read: by the documents API before its swap, or by another writer before the listener
        showed it), the row of the version the visibility shows. So a document changed while a
        search begins is found in one version, never in none; None when no version is shown."""
        row = self._row_of.get((row_id, version))
        if shown is None or (row is not None and _visible(row, shown)):
            return row
        return next(
            (held for held in reversed(self._rows_of_id.get(row_id, ())) if _visible(held, shown)), None
        )

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One query per row at the final probes: (scores, rows), shape (n, k)."""
        scores, ids, _ = self._search(queries, k, visibility)
        return scores, ids

    def search_text(
        self, queries: np.ndarray, k: int, texts: Sequence[str], depth: int, visibility: Visibility
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`search`, and each query's full-text ranking of rows (``depth`` of them, padded
        with ``-1``) by ``texts`` (one per query) in the same snapshot."""
        scores, ids, lexical = self._search(queries, k, visibility, _Words(texts, depth))
        assert lexical is not None
        return scores, ids, lexical

    def _search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None, words: _Words | None = None
    ) -> _Found:
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        with self.database.connection() as connection, _transaction(connection):
            opening = _opening(connection)
            return self._run(connection, matrix, k, self.nprobe, visibility, opening, last=True, words=words)

    def stages(
        self, queries: np.ndarray, k: int, plan: StagePlan, visibility: Visibility | None = None
    ) -> Iterator[StageResult]:
        """The running top-k at each stage's probes (:func:`stage_probes`), the last one the one-shot."""
        return (stage for stage, _ in self._staged(queries, k, plan, visibility))

    def stages_text(
        self,
        queries: np.ndarray,
        k: int,
        texts: Sequence[str],
        depth: int,
        plan: StagePlan,
        visibility: Visibility,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        """:meth:`stages`, each with the full-text ranking of rows (as :meth:`search_text` gives
        it) when its query carried one: the first stage to arrive always does."""
        return self._staged(queries, k, plan, visibility, _Words(texts, depth))

    def _staged(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan,
        visibility: Visibility | None,
        words: _Words | None = None,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        probes = stage_probes(plan, self.nprobe, self.queried)
        if self.mode is StageMode.SEQUENTIAL or len(probes) == 1:
            return self._sequential(matrix, k, probes, visibility, words)
        return self._parallel(matrix, k, probes, visibility, words)

    def _sequential(
        self,
        matrix: np.ndarray,
        k: int,
        probes: list[int],
        visibility: Visibility | None,
        words: _Words | None,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        started = time.perf_counter()
        with self.database.connection() as connection, _transaction(connection):
            for number, count in enumerate(probes, start=1):
                first, last = number == 1, number == len(probes)
                opening = _opening(connection) if first else ()
                ranked = words if first else None
                found = self._run(connection, matrix, k, count, visibility, opening, last, ranked)
                scores, ids, lexical = found
                now = time.perf_counter()
                yield StageResult(number, ids, scores, last, now - started), lexical
                started = now

    def _parallel(
        self,
        matrix: np.ndarray,
        k: int,
        probes: list[int],
        visibility: Visibility | None,
        words: _Words | None,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        # The full-text ranking goes with the first stage and with the final one, which may
        # arrive first; both read the one snapshot, so both rank alike.
        started = time.perf_counter()
        results: queue.SimpleQueue[tuple[int, _Found] | BaseException] = queue.SimpleQueue()
        snapshot: Future[str] = Future()
        imported, stop = threading.Event(), threading.Event()
        final = len(probes) - 1
        wait_s = self.database.settings.statement_timeout_s * (len(probes) + 2)

        def earlier() -> None:
            # Exports the snapshot, so the first stage starts at once and the final query waits
            # only for the export, not for the earlier stages.
            try:
                with self.database.connection() as connection, _transaction(connection):
                    snapshot.set_result(_export(connection))
                    for number, count in enumerate(probes[:-1]):
                        if stop.is_set():
                            break
                        ranked = words if number == 0 else None
                        found = self._run(connection, matrix, k, count, visibility, words=ranked)
                        results.put((number, found))
                    imported.wait(wait_s)  # the snapshot lives while this transaction does
            except BaseException as error:
                if not snapshot.done():
                    snapshot.set_exception(error)
                results.put(error)

        def lead() -> None:
            try:
                # The connection is taken (and checked) while the other one exports.
                with self.database.connection() as connection, _transaction(connection):
                    opening = _opening(connection, snapshot.result(wait_s))
                    found = self._run(
                        connection, matrix, k, probes[final], visibility, opening, last=True, words=words
                    )
                    imported.set()  # the export's transaction may end: this one has ended too
                    results.put((final, found))
            except BaseException as error:
                results.put(error)
            finally:
                imported.set()

        self._threads.submit(earlier)
        self._threads.submit(lead)
        shown = -1
        try:
            while True:
                try:
                    item = results.get(timeout=wait_s)
                except queue.Empty:
                    raise DatabaseUnavailableError(
                        f"a staged search on {self.database.settings.where} gave no stage in {wait_s:g}s"
                    ) from None
                if isinstance(item, BaseException):
                    raise item
                number, (scores, ids, lexical) = item
                if number <= shown:
                    continue  # an earlier stage that came after a later one: stale already
                now = time.perf_counter()
                yield StageResult(number + 1, ids, scores, number == final, now - started), lexical
                started, shown = now, number
                if number == final:
                    return
        finally:
            stop.set()
