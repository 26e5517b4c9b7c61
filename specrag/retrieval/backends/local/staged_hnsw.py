"""Staged HNSW search: faiss's graph, searched by a resumable numba kernel.

Neither faiss nor hnswlib can pause a graph search, and re-running it with a growing ``ef``
repeats work. :mod:`specrag.retrieval.backends.local.hnsw_kernels` keeps the beam in arrays so a search can
stop after some node expansions, report its running top-k and go on; it follows faiss's algorithm
step for step, so the final stage equals ``IndexHNSWFlat.search`` at the same ``efSearch``.
Count-based stages split the *expected* number of expansions (measured on stored vectors when
the searcher is created), as RAGCache splits the average HNSW search time into slices.

A live corpus (:mod:`specrag.retrieval.live_index`) inserts documents into the graph while it
serves (:meth:`StagedHNSW.add`). faiss moves the graph's arrays and the stored vectors as they
grow and rewires existing nodes' links, so an insert waits for the searches in flight (one stage
of the kernel, or one faiss search) and they wait for it; the kernel reads the arrays anew at each
stage. A graph cannot drop a node: :meth:`StagedHNSW.compacted` builds a new graph over the rows
kept, and maps its positions back to their row numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import faiss
import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local import hnsw_kernels
from specrag.retrieval.live_index import ReadWriteLock, Visibility, bitmap_selector
from specrag.retrieval.progress import add_in_chunks
from specrag.retrieval.search.stages import (
    UNBOUNDED,
    Capabilities,
    FaissBacked,
    StagePlan,
    StageResult,
    prepare_queries,
    run_stages,
)

__all__ = ["CALIBRATION_QUERIES", "StagedHNSW"]

CALIBRATION_QUERIES = 32
# faiss's bundled stubs lack SearchParametersHNSW.
_FAISS: Any = faiss
_WORST = np.finfo(np.float32).max
_ALL = np.zeros(0, dtype=np.uint8)  # the kernels' bitmap when a search is not filtered


class _BeamSearch:
    """The arrays of one query's search in progress (positions in the graph, not row numbers).

    Its calls read the searcher's graph and vectors as they are then: the caller holds the
    searcher's lock for reading across each (see :meth:`StagedHNSW.add`). ``allowed`` (a bitmap
    over graph positions, None: all) limits the results, not the walk.
    """

    def __init__(
        self, searcher: StagedHNSW, query: np.ndarray, k: int, allowed: np.ndarray | None = None
    ) -> None:
        self.searcher = searcher
        self.query = query
        self.allowed = _ALL if allowed is None else allowed
        self.filtered = allowed is not None
        ef = max(searcher.ef_search, k)
        self.visited = np.zeros(searcher.ntotal, dtype=np.uint8)
        self.queue_dis = np.empty(ef, dtype=np.float32)
        self.queue_ids = np.empty(ef, dtype=np.int32)
        self.result_dis = np.full(k, _WORST, dtype=np.float32)
        self.result_ids = np.full(k, -1, dtype=np.int64)
        self.state = np.zeros(hnsw_kernels.STATE_FIELDS, dtype=np.int64)
        graph = searcher.graph
        hnsw_kernels.enter(
            query, searcher.vectors, graph.neighbors, graph.offsets, graph.cum_neighbors,
            graph.entry_point, graph.max_level, searcher.inner_product,
            self.visited, self.queue_dis, self.queue_ids, self.result_dis, self.result_ids, self.state,
            self.allowed, self.filtered,
        )  # fmt: skip

    @property
    def finished(self) -> bool:
        return bool(self.state[hnsw_kernels.FINISHED])

    @property
    def expansions(self) -> int:
        return int(self.state[hnsw_kernels.EXPANSIONS])

    def expand(self, budget: int) -> bool:
        if self.finished:
            return True
        grown = self.searcher.ntotal - len(self.visited)
        if grown > 0:  # nodes inserted since the search began: its links may lead to them
            self.visited = np.concatenate([self.visited, np.zeros(grown, dtype=np.uint8)])
        graph = self.searcher.graph
        return bool(
            hnsw_kernels.expand(
                self.query, self.searcher.vectors, graph.neighbors, graph.offsets, graph.cum_neighbors,
                self.searcher.ef_search, self.searcher.inner_product,
                self.visited, self.queue_dis, self.queue_ids, self.result_dis, self.result_ids, self.state,
                budget, self.allowed, self.filtered,
            )
        )  # fmt: skip

    def sorted_into(self, distances: np.ndarray, ids: np.ndarray) -> None:
        """Results best first into these rows, as faiss reports them (similarities for inner product)."""
        hnsw_kernels.sorted_results(
            self.result_dis, self.result_ids, self.searcher.inner_product, _WORST, distances, ids
        )


class _Graph:
    """faiss's HNSW link arrays as the kernels read them: views of faiss's own (no copy), valid
    until the graph next grows (an insert may move them), so they are taken anew after each."""

    def __init__(self, hnsw: Any) -> None:
        self.neighbors = faiss.rev_swig_ptr(hnsw.neighbors.data(), hnsw.neighbors.size())
        # size_t offsets, read as the int64 the kernels index with (the same bits below 2**63).
        self.offsets = faiss.rev_swig_ptr(hnsw.offsets.data(), hnsw.offsets.size()).view(np.int64)
        self.cum_neighbors = faiss.vector_to_array(hnsw.cum_nneighbor_per_level).astype(np.int64)
        self.entry_point = int(hnsw.entry_point)
        self.max_level = int(hnsw.max_level)


class StagedHNSW(FaissBacked):
    """A faiss ``IndexHNSWFlat`` searchable in one shot (faiss) or in stages (numba kernel)."""

    kind = "hnsw"
    capabilities = Capabilities(live_rows=True)  # a graph has no centroids to re-train

    def __init__(
        self,
        index: faiss.IndexHNSWFlat,
        ef_search: int = 128,
        rows: np.ndarray | None = None,
        next_row: int | None = None,
    ) -> None:
        """``rows[p]`` is the row number of the graph's node ``p`` (None: ``p`` itself), and
        ``next_row`` the row the next :meth:`add` must start at (None: the number of nodes): a
        compacted graph holds rows with gaps between them."""
        if ef_search < 1:
            raise InvalidInputError(f"ef_search must be at least 1, got {ef_search}")
        self.owner = index
        # Any: faiss's bundled stubs omit most of the HNSW and storage API.
        self.index: Any = index
        self.ef_search = ef_search
        self.inner_product = index.metric_type == faiss.METRIC_INNER_PRODUCT
        self._rows = rows
        self._next_row = index.ntotal if next_row is None else next_row
        # An insert moves the arrays a search reads: it waits for the searches in flight, they for it.
        self._graph_lock = ReadWriteLock()
        # The last visibility a search was limited to, as a bitmap over graph positions (a
        # compacted graph's positions are not its rows): one per snapshot, not one per search.
        self._allowed: tuple[Visibility, int, np.ndarray] | None = None
        self._read_graph()
        self.expected_expansions = self._calibrate()

    def _read_graph(self) -> None:
        """Take the views of faiss's vector storage and graph arrays (no copy; ``self.owner``
        keeps them alive) anew: after an insert the old ones may point at freed memory."""
        storage: Any = faiss.downcast_index(self.index.storage)
        self.vectors = faiss.rev_swig_ptr(storage.get_xb(), self.ntotal * self.dim).reshape(
            self.ntotal, self.dim
        )
        self.graph = _Graph(self.index.hnsw)

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        *,
        metric: int = faiss.METRIC_INNER_PRODUCT,
        m: int = 32,
        ef_construction: int = 40,
        ef_search: int = 128,
        progress: bool = False,
        rows: np.ndarray | None = None,
        next_row: int | None = None,
    ) -> StagedHNSW:
        """Insert ``vectors`` in order into a new HNSW graph: row ``rows[i]`` (None: ``i``) is
        ``vectors[i]``, and the next add starts at ``next_row`` (a shard holds some rows only)."""
        num, dim = vectors.shape
        if num == 0:
            raise InvalidInputError("cannot build an index from zero vectors")
        index = _empty_graph(dim, metric, m, ef_construction)
        add_in_chunks(index, vectors, show=progress)
        return cls(index, ef_search, rows, next_row)

    @property
    def rows(self) -> np.ndarray:
        """The row number of each graph position."""
        return np.arange(self.ntotal, dtype=np.int64) if self._rows is None else self._rows

    def _calibrate(self) -> int:
        """Mean level-0 expansions of a full search (stored vectors as queries); also JIT-warms."""
        if self.ntotal == 0:
            return 1
        rows = np.random.default_rng(0).choice(
            self.ntotal, size=min(CALIBRATION_QUERIES, self.ntotal), replace=False
        )
        counts = []
        for row in rows:
            beam = _BeamSearch(self, np.ascontiguousarray(self.vectors[row]), 10)
            beam.expand(UNBOUNDED)
            counts.append(beam.expansions)
        return max(1, math.ceil(float(np.mean(counts))))

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "m": int(self.index.hnsw.nb_neighbors(1)),
            "ef_construction": int(self.index.hnsw.efConstruction),
            "ef_search": self.ef_search,
        }

    @property
    def next_row(self) -> int:
        """The row the next :meth:`add` must start at."""
        return self._next_row

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Insert ``vectors`` as rows ``first_row``, ``first_row + 1``, ... into the graph, as a
        build inserts its own; a search in flight waits for at most one insert."""
        matrix = self.vectors_to_add(vectors)
        if first_row != self._next_row:
            raise InvalidInputError(f"added rows must start at row {self._next_row}, got {first_row}")
        added = np.arange(first_row, first_row + len(matrix), dtype=np.int64)
        self.add_rows(matrix, None if self._rows is None else added, first_row + len(matrix))

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray | None, next_row: int) -> None:
        """Insert ``vectors`` as the given ``rows`` (None: the positions they take, for a graph
        whose positions are its rows), the next add to start at ``next_row``: a shard of a sharded
        index holds every N-th row, not a run of them."""
        matrix = self.vectors_to_add(vectors)
        with self._graph_lock.writing():
            if rows is not None:
                self._rows = np.concatenate([self.rows, rows])
            self.index.add(matrix)  # faiss numbers the new nodes on from ntotal
            self._next_row = next_row
            self._read_graph()

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows ``r`` with ``keep[r]`` and their vectors (a copy of faiss's flat storage)."""
        with self._graph_lock.reading():
            rows = self.rows
            chosen = np.asarray(keep)[rows]
            return rows[chosen], self.vectors[chosen]

    def compacted(self, keep: np.ndarray) -> StagedHNSW:
        """A new graph of the rows ``r`` with ``keep[r]`` under the same row numbers, built as
        this one was (same links per node and construction beam), searched at the same ``efSearch``."""
        rows, vectors = self.stored_vectors(keep)
        settings = self.settings
        index = _empty_graph(self.dim, self.index.metric_type, settings["m"], settings["ef_construction"])
        index.add(vectors)
        return StagedHNSW(index, self.ef_search, rows, len(keep))

    def _row_numbers(self, positions: np.ndarray) -> np.ndarray:
        """The row numbers of graph positions (same shape; -1 stays -1). An insert replaces the
        map with a longer one, never changing a position's row, so no lock is needed here."""
        rows = self._rows
        if rows is None:
            return positions
        return np.where(positions >= 0, rows[np.maximum(positions, 0)], -1)

    def _allowed_positions(self, visibility: Visibility | None) -> np.ndarray | None:
        """The graph positions ``visibility`` shows, as a bitmap (None: all): its own bitmap when
        positions are rows, else mapped through the positions' rows (cached per snapshot)."""
        if visibility is None:
            return None
        rows = self._rows
        if rows is None:
            return visibility.bitmap
        cached = self._allowed
        if cached is not None and cached[0] is visibility and cached[1] == len(rows):
            return cached[2]
        visible = visibility.visible
        shown = np.zeros(len(rows), dtype=bool)
        inside = rows < len(visible)  # rows added after the snapshot are hidden from it
        shown[inside] = visible[rows[inside]]
        bitmap = np.packbits(shown, bitorder="little")
        self._allowed = (visibility, len(rows), bitmap)
        return bitmap

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One-shot faiss search at this searcher's ``efSearch``: (distances, ids), shape (n, k);
        only rows ``visibility`` shows, when given (the graph is still walked through the others)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        params = _FAISS.SearchParametersHNSW()
        params.efSearch = self.ef_search
        allowed = self._allowed_positions(visibility)  # alive while faiss reads it
        selector = None if allowed is None else bitmap_selector(allowed)
        if selector is not None:
            params.sel = selector
        with self._graph_lock.reading():
            distances, positions = self.index.search(matrix, k, params=params)
        return distances, self._row_numbers(positions)

    def stages(
        self, queries: np.ndarray, k: int, plan: StagePlan, visibility: Visibility | None = None
    ) -> Iterator[StageResult]:
        """Expand the beams of all queries stage by stage; each stage yields the running top-k
        (only rows ``visibility`` shows, when given)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        return self._stages(matrix, k, plan, visibility)

    @property
    def expected_units(self) -> int:
        """The work of a whole search: the node expansions an average one takes."""
        return self.expected_expansions

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> _HNSWCursor:
        """A search of ``queries`` to be advanced expansion by expansion (only rows ``visibility`` shows)."""
        return _HNSWCursor(self, prepare_queries(queries, self.dim, self.ntotal, k), k, visibility)

    def _stages(
        self, matrix: np.ndarray, k: int, plan: StagePlan, visibility: Visibility | None
    ) -> Iterator[StageResult]:
        cursor = _HNSWCursor(self, matrix, k, visibility)
        yield from run_stages(cursor.advance, cursor.snapshot, plan, expected_units=self.expected_expansions)


class _HNSWCursor:
    """The beams of one batch's searches, expanded a number of nodes per :meth:`advance`."""

    def __init__(
        self, searcher: StagedHNSW, matrix: np.ndarray, k: int, visibility: Visibility | None
    ) -> None:
        self._searcher = searcher
        self._k = k
        with searcher._graph_lock.reading():
            allowed = searcher._allowed_positions(visibility)
            self._beams = [_BeamSearch(searcher, query, k, allowed) for query in matrix]

    def advance(self, units: int) -> bool:
        with self._searcher._graph_lock.reading():
            return all([beam.expand(units) for beam in self._beams])

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        distances = np.empty((len(self._beams), self._k), dtype=np.float32)
        positions = np.empty((len(self._beams), self._k), dtype=np.int64)
        for row, beam in enumerate(self._beams):
            beam.sorted_into(distances[row], positions[row])
        return distances, self._searcher._row_numbers(positions)


def _empty_graph(dim: int, metric: int, m: int, ef_construction: int) -> faiss.IndexHNSWFlat:
    """An HNSW graph with no node yet: ``m`` links a node (twice that on level 0), inserts
    searching ``ef_construction`` deep."""
    index = faiss.IndexHNSWFlat(dim, m, metric)
    index.hnsw.efConstruction = ef_construction
    return index
