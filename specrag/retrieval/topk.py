"""A running top-k over result slices, kept in faiss's own heaps.

Merging slice results with faiss's heap routines (the ones a one-shot search uses, ties broken
by id the same way) is what makes the last stage of a staged search equal the one-shot result
rather than merely close to it.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

__all__ = ["RunningTopK"]


def _heaps(distances: np.ndarray, ids: np.ndarray, keep_max: bool) -> Any:
    heaps = faiss.float_minheap_array_t() if keep_max else faiss.float_maxheap_array_t()
    heaps.nh, heaps.k = distances.shape
    heaps.val = faiss.swig_ptr(distances)
    heaps.ids = faiss.swig_ptr(ids)
    return heaps


class RunningTopK:
    """The best ``k`` (distance, id) pairs per query seen so far; ``keep_max`` for similarities."""

    def __init__(self, num_queries: int, k: int, keep_max: bool) -> None:
        self._keep_max = keep_max
        self._distances = np.empty((num_queries, k), dtype=np.float32)
        self._ids = np.empty((num_queries, k), dtype=np.int64)
        # The heap struct holds raw pointers: the arrays above must outlive it (they do, as fields).
        self._heaps = _heaps(self._distances, self._ids, keep_max)
        self._heaps.heapify()

    def add(self, distances: np.ndarray, ids: np.ndarray) -> None:
        """Offer one slice's results, shape (num_queries, any width)."""
        distances = np.ascontiguousarray(distances, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        width = distances.shape[1]
        self._heaps.addn_with_ids(width, faiss.swig_ptr(distances), faiss.swig_ptr(ids), width)

    def sorted(self) -> tuple[np.ndarray, np.ndarray]:
        """A sorted copy (best first, ``-1`` ids padding), leaving the running heaps intact."""
        distances, ids = self._distances.copy(), self._ids.copy()
        _heaps(distances, ids, self._keep_max).reorder()
        return distances, ids
