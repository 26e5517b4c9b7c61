"""Staged IVF search over faiss: one coarse quantization, then the probe list in slices.

Scanning the ``nprobe`` nearest inverted lists in order, a slice at a time, and merging each
slice's top-k gives the same final answer as one ``search`` call, while every slice boundary
offers a running top-k to speculate on. The per-slice cost is one extra ``search_preassigned``
call, which is noise once a search takes more than a few milliseconds (docs/staged-search.md
has the figures).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import faiss
import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.topk import RunningTopK, exact_top
from specrag.retrieval.live_index import ReadWriteLock, Visibility, bitmap_selector
from specrag.retrieval.progress import add_in_chunks
from specrag.retrieval.search.stages import (
    Capabilities,
    FaissBacked,
    StagePlan,
    StageResult,
    prepare_queries,
    run_stages,
)

__all__ = [
    "DEFAULT_NLIST",
    "IVF_CODES",
    "MAX_TRAIN_POINTS_PER_LIST",
    "MIN_DEFAULT_NPROBE",
    "MIN_POINTS_PER_LIST",
    "PQ_BITS",
    "StagedIVF",
    "choose_nlist",
    "default_nprobe",
]

logger = logging.getLogger(__name__)
# faiss's k-means wants at least this many training points per list; fewer lists beat bad ones.
MIN_POINTS_PER_LIST = 39
DEFAULT_NLIST = 1024
# Training on more than this many points per list buys little and costs build time.
MAX_TRAIN_POINTS_PER_LIST = 256
PQ_BITS = 8
# Lists a default search probes at the least (see default_nprobe).
MIN_DEFAULT_NPROBE = 32
# How an IVF index stores its vectors in the lists: exact float32 ("flat"), product-quantized
# ("pq": pq_m bytes a vector), or one byte a dimension ("sq8": a quarter of flat's memory). A
# scan reads its lists once, so the codes set how much memory bandwidth a search takes from an
# engine on the same machine (docs/vllm-cpu.md: a flat scan slows a prefill on the other core
# many times as much as an SQ8 scan).
IVF_CODES = ("flat", "pq", "sq8")


def choose_nlist(num_vectors: int, requested: int = DEFAULT_NLIST) -> int:
    """``requested`` lists, fewer for small corpora so every list gets enough training points."""
    if requested < 1:
        raise InvalidInputError(f"nlist must be at least 1, got {requested}")
    return max(1, min(requested, num_vectors // MIN_POINTS_PER_LIST))


def default_nprobe(nlist: int) -> int:
    """A quarter of the lists, at least :data:`MIN_DEFAULT_NPROBE` (all of a smaller index).

    A quarter keeps recall near 1 on large indexes and leaves enough lists to cut into stages.
    A small corpus has few lists (rows / 39), where a quarter of them misses true neighbours
    (docs/retrieval.md has the figures) while scanning them all costs next to nothing.
    """
    return max(1, min(nlist, max(nlist // 4, MIN_DEFAULT_NPROBE)))


class StagedIVF(FaissBacked):
    """A faiss IVF index (flat, PQ or SQ8 codes) searchable in one shot or in stages."""

    kind = "ivf"
    capabilities = Capabilities(live_rows=True, retrains=True)

    def __init__(self, index: faiss.Index, nprobe: int | None = None, next_row: int | None = None) -> None:
        """``next_row`` is the row the next :meth:`add` must start at (None: the number of rows
        held): a compacted index holds rows with gaps between them."""
        # The downcast proxy does not own the C++ object: keep the owner alive alongside it.
        self.owner = index
        # Any: faiss's bundled stubs omit the low-level SWIG methods used here.
        self.index: Any = faiss.extract_index_ivf(index)
        self.nprobe = default_nprobe(self.index.nlist) if nprobe is None else nprobe
        if self.nprobe < 1:
            raise InvalidInputError(f"nprobe must be at least 1, got {self.nprobe}")
        self.nprobe = min(self.nprobe, self.index.nlist)
        # Adding vectors may move a list's storage; a scan must never read it mid-move, so an add
        # waits for the scans in flight (one stage's slice each) and scans wait for it (:meth:`add`).
        self._lists_lock = ReadWriteLock()
        self._next_row = int(index.ntotal) if next_row is None else next_row
        if self.nprobe == 1:
            logger.warning(
                "this IVF index searches one list (nlist %d, nprobe 1): a search is a single stage, so "
                "nothing is speculated during it; a corpus of %d+ passages, --pad-to, --nprobe 2+ or "
                "--kind hnsw gives it stages",
                self.index.nlist,
                2 * MIN_POINTS_PER_LIST,  # two lists: choose_nlist gives one below this
            )

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        *,
        metric: int = faiss.METRIC_INNER_PRODUCT,
        nlist: int = DEFAULT_NLIST,
        nprobe: int | None = None,
        codes: str = "flat",
        pq_m: int = 16,
        seed: int = 0,
        progress: bool = False,
        add: bool = True,
    ) -> StagedIVF:
        """Train on a sample of ``vectors`` and add them all (unless not ``add``); row i of the
        index is ``vectors[i]``.

        ``codes`` is one of :data:`IVF_CODES`; ``pq_m`` (bytes per vector) applies to ``pq`` only.
        """
        num, dim = vectors.shape
        if num == 0:
            raise InvalidInputError("cannot build an index from zero vectors")
        if codes not in IVF_CODES:
            raise InvalidInputError(f"unknown IVF codes {codes!r}; choose one of {', '.join(IVF_CODES)}")
        lists = choose_nlist(num, nlist)
        quantizer = faiss.IndexFlat(dim, metric)
        index: Any
        if codes == "flat":
            index = faiss.IndexIVFFlat(quantizer, dim, lists, metric)
        elif codes == "sq8":
            index = faiss.IndexIVFScalarQuantizer(
                quantizer, dim, lists, faiss.ScalarQuantizer.QT_8bit, metric
            )
        else:
            needed = MIN_POINTS_PER_LIST * (1 << PQ_BITS)  # to train 256 centroids per sub-vector
            if num < needed:
                raise InvalidInputError(
                    f"IVF-PQ needs at least {needed} vectors to train its codebooks, the corpus has {num}: "
                    f"use --kind ivf, or --pad-to {needed} to add synthetic rows"
                )
            if dim % pq_m:
                raise InvalidInputError(f"IVF-PQ needs the dimension ({dim}) divisible by pq_m ({pq_m})")
            index = faiss.IndexIVFPQ(quantizer, dim, lists, pq_m, PQ_BITS, metric)
        index.cp.seed = seed
        train_size = min(num, lists * MAX_TRAIN_POINTS_PER_LIST)
        sample = np.random.default_rng(seed).choice(num, size=train_size, replace=False)
        index.train(np.ascontiguousarray(vectors[np.sort(sample)], dtype=np.float32))
        if add:
            add_in_chunks(index, vectors, show=progress)
        return cls(index, nprobe)

    @property
    def nlist(self) -> int:
        """The index's lists (what a probe share is a share of; the pgvector searcher's too)."""
        return int(self.index.nlist)

    @property
    def settings(self) -> dict[str, Any]:
        """What a manifest records to rebuild this searcher around the saved faiss index."""
        return {"kind": self.kind, "codes": self.codes, "nlist": self.nlist, "nprobe": self.nprobe}

    @property
    def codes(self) -> str:
        """How the lists store vectors: one of :data:`IVF_CODES`."""
        # extract_index_ivf returns the IndexIVF base class: downcast to see the codes.
        concrete = faiss.downcast_index(self.index)
        if isinstance(concrete, faiss.IndexIVFPQ):
            return "pq"
        if isinstance(concrete, faiss.IndexIVFScalarQuantizer):
            return "sq8"
        return "flat"

    @property
    def next_row(self) -> int:
        """The row the next :meth:`add` must start at."""
        return self._next_row

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Add ``vectors`` as rows ``first_row`` (:attr:`next_row`), ``first_row + 1``, ... to the
        lists of their nearest centroids, as a build adds its own; a search in flight waits for at
        most one add. Any other first row is refused: the lists' ids must stay the index's rows."""
        matrix = self.vectors_to_add(vectors)
        if first_row != self._next_row:
            raise InvalidInputError(f"added rows must start at row {self._next_row}, got {first_row}")
        self.add_rows(
            matrix,
            np.arange(first_row, first_row + len(matrix), dtype=np.int64),
            self._next_row + len(matrix),
        )

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None:
        """Add ``vectors`` as the given ``rows`` (checked by the caller), the next add to start at
        ``next_row``: a shard of a sharded index holds every N-th row, not a run of them."""
        with self._lists_lock.writing():
            self.owner.add_with_ids(self.vectors_to_add(vectors), np.ascontiguousarray(rows, dtype=np.int64))
            self._next_row = next_row

    def compacted(self, keep: np.ndarray) -> StagedIVF:
        """A copy holding only the rows ``r`` with ``keep[r]``: the same centroids and codes, the
        hidden rows' entries gone from the lists (no vector is decoded or re-encoded)."""
        compact: Any = faiss.clone_index(self.owner)
        compact.reset()  # empties the lists, keeps the trained quantizer and codes
        source, target = self.index.invlists, faiss.extract_index_ivf(compact).invlists
        assert target is not None
        code_size, kept = source.code_size, 0
        with self._lists_lock.reading():
            for number in range(self.index.nlist):
                size = source.list_size(number)
                if not size:
                    continue
                ids = faiss.rev_swig_ptr(source.get_ids(number), size).copy()
                codes = faiss.rev_swig_ptr(source.get_codes(number), size * code_size).copy()
                chosen = keep[ids]
                if chosen.any():
                    kept_ids = np.ascontiguousarray(ids[chosen])
                    kept_codes = np.ascontiguousarray(codes.reshape(size, code_size)[chosen])
                    target.add_entries(
                        number, len(kept_ids), faiss.swig_ptr(kept_ids), faiss.swig_ptr(kept_codes)
                    )
                    kept += len(kept_ids)
        faiss.extract_index_ivf(compact).ntotal = kept
        compact.ntotal = kept
        return StagedIVF(compact, self.nprobe, len(keep))

    def centroid_distance(self, vectors: np.ndarray) -> np.ndarray:
        """How far each of ``vectors`` lies from its nearest centroid (1 - inner product for the
        unit vectors the embedders give): what a live index watches for drift."""
        similarity, _ = self.index.quantizer.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)
        distance: np.ndarray = 1.0 - similarity[:, 0]
        return distance

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows ``r`` with ``keep[r]`` and their vectors, read from flat lists (which hold the
        vectors themselves; SQ8 and PQ codes would have to be decoded, with their error)."""
        if self.codes != "flat":
            raise InvalidInputError(
                f"re-training reads the vectors from flat lists; these hold {self.codes} codes"
            )
        invlists, rows, vectors = self.index.invlists, [], []
        with self._lists_lock.reading():
            for number in range(self.index.nlist):
                size = invlists.list_size(number)
                if not size:
                    continue
                ids = faiss.rev_swig_ptr(invlists.get_ids(number), size).copy()
                codes = faiss.rev_swig_ptr(invlists.get_codes(number), size * self.dim * 4).copy()
                chosen = keep[ids]
                rows.append(ids[chosen])
                vectors.append(codes.view(np.float32).reshape(size, self.dim)[chosen])
        return np.concatenate(rows), np.concatenate(vectors)

    def retrained(self, keep: np.ndarray, seed: int = 0) -> StagedIVF:
        """A new index of the rows ``r`` with ``keep[r]`` under the same row numbers, its centroids
        trained anew on them (as a build trains on its corpus), with as many lists and probes."""
        rows, vectors = self.stored_vectors(keep)
        fresh = StagedIVF.build(
            vectors, metric=self.index.metric_type, nlist=self.index.nlist, seed=seed, add=False
        )
        fresh.owner.add_with_ids(np.ascontiguousarray(vectors), np.ascontiguousarray(rows, dtype=np.int64))
        fresh.nprobe = min(self.nprobe, fresh.index.nlist)
        fresh._next_row = len(keep)
        return fresh

    @staticmethod
    def _params(nprobe: int, selector: Any) -> faiss.SearchParametersIVF:
        """faiss's parameters for a scan of ``nprobe`` lists; only the rows ``selector`` selects
        (a :func:`~specrag.retrieval.live_index.bitmap_selector`, None: all) are scored."""
        params = faiss.SearchParametersIVF()
        params.nprobe = nprobe
        if selector is not None:
            params.sel = selector
        return params

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One-shot faiss search at this searcher's ``nprobe``: (distances, ids), shape (n, k);
        only rows ``visibility`` shows, when given."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        bitmap = None if visibility is None else visibility.bitmap  # alive while faiss reads it
        selector = None if bitmap is None else bitmap_selector(bitmap)
        params = self._params(self.nprobe, selector)
        keep_max = self.index.metric_type == faiss.METRIC_INNER_PRODUCT
        with self._lists_lock.reading():
            return exact_top(lambda width: self.index.search(matrix, width, params=params), k, keep_max)

    def stages(
        self, queries: np.ndarray, k: int, plan: StagePlan, visibility: Visibility | None = None
    ) -> Iterator[StageResult]:
        """Scan the probe list in slices; each stage yields the running top-k of every query
        (only rows ``visibility`` shows, when given)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        return self._stages(matrix, k, plan, None if visibility is None else visibility.bitmap)

    @property
    def expected_units(self) -> int:
        """The work of a whole search: the lists probed."""
        return self.nprobe

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> _IVFCursor:
        """A search of ``queries`` to be advanced list by list (only rows ``visibility`` shows)."""
        matrix = prepare_queries(queries, self.dim, self.ntotal, k)
        return _IVFCursor(self, matrix, k, None if visibility is None else visibility.bitmap)

    def _stages(
        self, matrix: np.ndarray, k: int, plan: StagePlan, bitmap: np.ndarray | None
    ) -> Iterator[StageResult]:
        started = time.perf_counter()
        cursor = _IVFCursor(self, matrix, k, bitmap)
        yield from run_stages(cursor.advance, cursor.snapshot, plan, self.nprobe, started=started)


class _IVFCursor:
    """One search's probe list (from one coarse quantization) and its running top-k, scanned a
    slice of lists per :meth:`advance`."""

    def __init__(self, ivf: StagedIVF, matrix: np.ndarray, k: int, bitmap: np.ndarray | None) -> None:
        self._ivf = ivf
        self._matrix = matrix
        self._k = k
        self._bitmap = bitmap  # alive while faiss reads it through the selector
        self._selector = None if bitmap is None else bitmap_selector(bitmap)
        index = ivf.index
        self._coarse_distances, self._coarse_lists = index.quantizer.search(matrix, ivf.nprobe)
        self._keep_max = index.metric_type == faiss.METRIC_INNER_PRODUCT
        self._top = RunningTopK(len(matrix), k, self._keep_max)
        self._scanned = 0

    def advance(self, units: int) -> bool:
        ivf, num, k = self._ivf, len(self._matrix), self._k
        end = min(ivf.nprobe, self._scanned + units)
        lists = np.ascontiguousarray(self._coarse_lists[:, self._scanned : end])
        centroid_distances = np.ascontiguousarray(self._coarse_distances[:, self._scanned : end])
        params = ivf._params(end - self._scanned, self._selector)

        def scan(width: int) -> tuple[np.ndarray, np.ndarray]:
            distances = np.empty((num, width), dtype=np.float32)
            ids = np.empty((num, width), dtype=np.int64)
            ivf.index.search_preassigned_c(
                num,
                faiss.swig_ptr(self._matrix),
                width,
                faiss.swig_ptr(lists),
                faiss.swig_ptr(centroid_distances),
                faiss.swig_ptr(distances),
                faiss.swig_ptr(ids),
                False,
                params,
                None,
            )
            return distances, ids

        with ivf._lists_lock.reading():
            self._top.add(*exact_top(scan, k, self._keep_max))
        self._scanned = end
        return self._scanned == ivf.nprobe

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self._top.sorted()
