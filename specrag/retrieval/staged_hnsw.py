"""Staged HNSW search: faiss's graph, searched by a resumable numba kernel.

Neither faiss nor hnswlib can pause a graph search, and re-running it with a growing ``ef``
repeats work. :mod:`specrag.retrieval.hnsw_kernels` keeps the beam in arrays so a search can stop
after some node expansions, report its running top-k and go on; it follows faiss's algorithm
step for step, so the final stage equals ``IndexHNSWFlat.search`` at the same ``efSearch``.
Count-based stages split the *expected* number of expansions (measured on stored vectors when
the searcher is created), as RAGCache splits the average HNSW search time into slices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import faiss
import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval import hnsw_kernels
from specrag.retrieval.progress import add_in_chunks
from specrag.retrieval.stages import (
    UNBOUNDED,
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


class _BeamSearch:
    """The arrays of one query's search in progress."""

    def __init__(self, searcher: StagedHNSW, query: np.ndarray, k: int) -> None:
        self.searcher = searcher
        self.query = query
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
        graph = self.searcher.graph
        return bool(
            hnsw_kernels.expand(
                self.query, self.searcher.vectors, graph.neighbors, graph.offsets, graph.cum_neighbors,
                self.searcher.ef_search, self.searcher.inner_product,
                self.visited, self.queue_dis, self.queue_ids, self.result_dis, self.result_ids, self.state,
                budget,
            )
        )  # fmt: skip

    def sorted_into(self, distances: np.ndarray, ids: np.ndarray) -> None:
        """Results best first into these rows, as faiss reports them (similarities for inner product)."""
        hnsw_kernels.sorted_results(
            self.result_dis, self.result_ids, self.searcher.inner_product, _WORST, distances, ids
        )


class _Graph:
    """faiss's HNSW link arrays, copied once into numpy for the kernels."""

    def __init__(self, hnsw: Any) -> None:
        self.neighbors = faiss.vector_to_array(hnsw.neighbors).astype(np.int32)
        self.offsets = faiss.vector_to_array(hnsw.offsets).astype(np.int64)
        self.cum_neighbors = faiss.vector_to_array(hnsw.cum_nneighbor_per_level).astype(np.int64)
        self.entry_point = int(hnsw.entry_point)
        self.max_level = int(hnsw.max_level)


class StagedHNSW(FaissBacked):
    """A faiss ``IndexHNSWFlat`` searchable in one shot (faiss) or in stages (numba kernel)."""

    kind = "hnsw"

    def __init__(self, index: faiss.IndexHNSWFlat, ef_search: int = 128) -> None:
        if ef_search < 1:
            raise InvalidInputError(f"ef_search must be at least 1, got {ef_search}")
        self.owner = index
        # Any: faiss's bundled stubs omit most of the HNSW and storage API.
        self.index: Any = index
        self.ef_search = ef_search
        self.inner_product = index.metric_type == faiss.METRIC_INNER_PRODUCT
        storage: Any = faiss.downcast_index(index.storage)
        # A view of faiss's own vector storage (no copy); ``self.owner`` keeps it alive.
        self.vectors = faiss.rev_swig_ptr(storage.get_xb(), index.ntotal * index.d).reshape(
            index.ntotal, index.d
        )
        self.graph = _Graph(index.hnsw)
        self.expected_expansions = self._calibrate()

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
    ) -> StagedHNSW:
        """Insert ``vectors`` in order (row i = ``vectors[i]``) into a new HNSW graph."""
        num, dim = vectors.shape
        if num == 0:
            raise InvalidInputError("cannot build an index from zero vectors")
        index = faiss.IndexHNSWFlat(dim, m, metric)
        index.hnsw.efConstruction = ef_construction
        add_in_chunks(index, vectors, show=progress)
        return cls(index, ef_search)

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

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One-shot faiss search at this searcher's ``efSearch``: (distances, ids), shape (n, k)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        distances, ids = self.index.search(
            matrix, k, params=_FAISS.SearchParametersHNSW(efSearch=self.ef_search)
        )
        return distances, ids

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        """Expand the beams of all queries stage by stage; each stage yields the running top-k."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        return self._stages(matrix, k, plan)

    def _stages(self, matrix: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        beams = [_BeamSearch(self, query, k) for query in matrix]

        def advance(units: int) -> bool:
            return all([beam.expand(units) for beam in beams])

        def snapshot() -> tuple[np.ndarray, np.ndarray]:
            distances = np.empty((len(beams), k), dtype=np.float32)
            ids = np.empty((len(beams), k), dtype=np.int64)
            for row, beam in enumerate(beams):
                beam.sorted_into(distances[row], ids[row])
            return distances, ids

        yield from run_stages(advance, snapshot, plan, expected_units=self.expected_expansions)
