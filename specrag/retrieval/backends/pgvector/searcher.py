"""Staged search of a pgvector table by nested IVFFlat probes, all stages in one snapshot.

No database streams a running top-k from one query, but IVFFlat probes the ``ivfflat.probes``
lists nearest the query and scores their rows exactly, so a query at more probes scans a superset
of the rows a query at fewer probes scanned: its top-k refines the other's. A stage is therefore
a whole query at the stage's share of the final probes (the stage plan's share, as the
in-process IVF scans that share of its probe list), and the last stage is the one-shot query
itself, every stage in one snapshot (:mod:`queries`).

The stages run as separate queries, each re-scanning the lists of the one before, so a stage
between the first and the final costs its whole share again and only gives a later chance to
correct a stale speculation. By default (``ends``) a search queries the plan's first stage, where
speculation starts, and its final one: their database time is the one-shot query's and the first
stage's share more; ``every`` queries each stage of the plan (the geometric plan's shares sum to
about 2) for a running top-k that refines at each. Run one after the other on one connection
(``sequential``), the final result arrives after all of them; ``parallel`` (:mod:`parallel`) runs
the final query on a second connection, on the earlier stages' snapshot.

An HNSW table is staged the same way with a growing ``hnsw.ef_search`` (at least the rows a query
asks for) in place of the probes. A wider candidate list is not guaranteed to find every row a
narrower one found, so the stages of an HNSW search need not nest; the final stage is still the
one-shot query, and on the tables measured no stage's i-th best was worse than the stage before
(docs/backends.md). pgvector 0.8's iterative scans (``hnsw.iterative_scan``) resume a scan when
filtering leaves fewer rows than the LIMIT; these queries filter nothing, so they change no result.

With the full-text channel (``--pg-lexical fts``, :meth:`PgVectorSearcher.search_text`,
:meth:`PgVectorSearcher.stages_text`), each query's full-text ranking goes in the pipeline of the
first stage's transaction, and in the ``parallel`` mode of the final stage's too (which may
arrive first): it reads the stages' snapshot and costs no round trip of its own.

A whole search runs under one deadline on the client (``--pg-search-timeout``, below the
first-token timeout): past it, its calls are cut (:mod:`deadline`) and it fails with
:class:`~specrag.errors.DatabaseUnavailableError`, so a silent database never holds the search
thread. Scores are similarities, higher first, as the in-process indexes give for unit vectors:
the inner product (``ip``), 1 - the cosine distance (``cosine``), or minus the squared L2 distance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import default_nprobe
from specrag.retrieval.backends.pgvector.config import (
    DEFAULT_HNSW_EF_SEARCH,
    DEFAULT_STAGE_MODE,
    StageMode,
    StageQueries,
)
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.deadline import Deadline
from specrag.retrieval.backends.pgvector.parallel import parallel_stages
from specrag.retrieval.backends.pgvector.queries import (
    MAX_EF_SEARCH,
    Found,
    StagedQuery,
    TableSearch,
    Words,
    opening,
    stage_probes,
    transaction,
)
from specrag.retrieval.backends.pgvector.rows import RowNames
from specrag.retrieval.backends.pgvector.table import TableLayout
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import (
    Capabilities,
    StagedSearcher,
    StagePlan,
    StageResult,
    prepare_queries,
)

__all__ = ["NO_CHANGE_TRIGGER", "PgVectorSearcher", "served_table", "stage_probes"]

# Why other writers' changes go unnoticed while serving until a change trigger is installed.
NO_CHANGE_TRIGGER = "no change trigger installed"


class PgVectorSearcher:
    """A :class:`~specrag.retrieval.search.stages.StagedSearcher` over a pgvector table; row ``i`` is the
    ``i``-th of ``row_ids`` (the table's ids as text, read once at start) at ``versions[i]``.

    A row is named by its id and version (``version_column``; None: every row is version 1), so
    that a version the documents API writes gets a row of its own (:meth:`map_rows`), and a
    search whose snapshot still holds the version before finds the row that names it. A key
    found in the table that names no row (another writer's) is skipped (:mod:`rows`).
    """

    kind = "pgvector"
    owner: Any = None  # nothing to save: the table is the index

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
        documents_off: str | None = None,
        changes_off: str | None = NO_CHANGE_TRIGGER,
    ) -> None:
        self.database = database
        self.layout = layout
        self.mode = StageMode(mode)
        self.queried = StageQueries(queried)
        #: The final stage's ``ivfflat.probes`` (the one-shot query's), as :class:`StagedIVF` names
        #: it; on an HNSW table, its ``hnsw.ef_search``.
        if layout.method == "hnsw":
            self.nprobe = min(MAX_EF_SEARCH, DEFAULT_HNSW_EF_SEARCH if nprobe is None else nprobe)
        else:
            self.nprobe = min(layout.lists, default_nprobe(layout.lists) if nprobe is None else nprobe)
        if self.nprobe < 1:
            raise InvalidInputError(f"--nprobe must be at least 1, got {self.nprobe}")
        self._names = RowNames(row_ids, versions)
        self.version_column = version_column
        #: Why the documents API may not write this table (None: it may), as whoever opened it found.
        self.documents_off = documents_off
        if version_column is None and documents_off is None:
            self.documents_off = "the table has no version column"
        #: Why changes by other writers are not noticed while serving (None: a trigger reports them).
        self.changes_off = changes_off
        #: What to stop before the connections close (a change listener), called by :meth:`close`.
        self.on_close: list[Callable[[], None]] = []
        #: Rows are mapped while it serves (:meth:`map_rows`). A search's snapshot may hold versions
        #: its visibility does not show yet: it takes the visibility always, to show the version the
        #: visibility does instead (:mod:`rows`). With ``fulltext`` it ranks query texts by the
        #: table's full-text search (:meth:`search_text`).
        self.capabilities = Capabilities(live_rows=True, snapshot_rows=True, ranks_text=fulltext)
        self._table = TableSearch(database.settings, layout, self._names, version_column, fulltext)
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
        return self._names.count

    @property
    def nlist(self) -> int:
        """The IVFFlat index's lists (what a probe share is a share of); 0 on an HNSW table."""
        return self.layout.lists

    @property
    def next_row(self) -> int:
        """The row the next :meth:`map_rows` must start at (a :class:`Growable`'s)."""
        return self._names.count

    def keys(self) -> list[tuple[str, int]]:
        """Each row's (id, version), in row order; a row whose key was re-mapped names its last."""
        return self._names.keys()

    def map_rows(self, keys: Sequence[tuple[str, int]], first_row: int) -> None:
        """Name rows ``first_row``, ``first_row + 1``, ... by the table's (id, version) ``keys``:
        versions committed to the table (by :class:`~specrag.retrieval.backends.pgvector.writes.TableWriter`)
        that searches should find as these rows. The rows of the versions before stay mapped, for
        searches whose snapshot still holds them (the index hides them from newer ones)."""
        self._names.map_rows(keys, first_row)

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
            "fulltext": self.capabilities.ranks_text,
        }

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop()()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.database.close()

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
        scores, ids, lexical = self._search(queries, k, visibility, Words(texts, depth))
        assert lexical is not None
        return scores, ids, lexical

    def _search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None, words: Words | None = None
    ) -> Found:
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        deadline = Deadline.after(self.database.settings.search_timeout_s)
        with self.database.connection(deadline) as connection, transaction(connection):
            statements = opening(connection)
            return self._table.run(connection, matrix, k, self.nprobe, visibility, statements, True, words)

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
        return self._staged(queries, k, plan, visibility, Words(texts, depth))

    def _staged(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan,
        visibility: Visibility | None,
        words: Words | None = None,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        probes = stage_probes(plan, self.nprobe, self.queried)
        query = StagedQuery(matrix, k, probes, visibility, words)
        if self.mode is StageMode.SEQUENTIAL or len(probes) == 1:
            return self._sequential(query)
        return parallel_stages(self.database, self._table, self._threads, query)

    def _sequential(self, query: StagedQuery) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        started = time.perf_counter()
        deadline = Deadline.after(self.database.settings.search_timeout_s)
        with self.database.connection(deadline) as connection, transaction(connection):
            for number, count in enumerate(query.probes, start=1):
                first, last = number == 1, number == len(query.probes)
                statements = opening(connection) if first else ()
                ranked = query.words if first else None
                scores, ids, lexical = self._table.run(
                    connection, query.matrix, query.k, count, query.visibility, statements, last, ranked
                )
                now = time.perf_counter()
                yield StageResult(number, ids, scores, last, now - started), lexical
                started = now


def served_table(searcher: StagedSearcher) -> PgVectorSearcher:
    """``searcher`` as the pgvector table whose rows are the documents' record (what the table's
    corpus writes and follows); InvalidInputError for another backend's searcher."""
    if not isinstance(searcher, PgVectorSearcher):
        raise InvalidInputError(f"a {searcher.kind} index is not a pgvector table")
    return searcher
