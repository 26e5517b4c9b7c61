"""A running top-k over result slices, under one total order: the distance, then the row.

faiss's heaps keep the first of several rows at the same distance that a scan happens to meet
(an equal candidate does not displace the heap's worst), so which of them survive the k-th place
depends on the order the rows were scanned in: the unsharded index scans a list's rows in row
order, each shard only its own rows, and a merge of shards sees them shard by shard. Under a total
order (equal distances: the smaller row first) the best ``k`` of a set of rows does not depend on
how they were scanned, cut into stages or split into shards; so every slice is searched for its
exact best ``k`` (:func:`exact_top`) and merged here, and the last stage of a staged search, or
of a merge of shards, equals the one-shot search of the whole index exactly, ties included.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["RunningTopK", "best_first", "exact_top"]

# What faiss pads a result with: the worst distance of its metric, and row -1.
_WORST_SIMILARITY = float(np.finfo(np.float32).min)
_WORST_DISTANCE = float(np.finfo(np.float32).max)


def best_first(
    distances: np.ndarray, ids: np.ndarray, k: int, keep_max: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best ``k`` of (``distances``, ``ids``) under the total order: the best distance
    first (the largest when ``keep_max``), equal distances by the smaller id, padding (-1) last."""
    primary = -distances if keep_max else distances
    order = np.lexsort((ids, primary, ids < 0), axis=-1)[:, :k]
    return np.take_along_axis(distances, order, axis=1), np.take_along_axis(ids, order, axis=1)


def exact_top(
    search: Callable[[int], tuple[np.ndarray, np.ndarray]], k: int, keep_max: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` under the total order of what ``search(width)`` (a faiss search for the best
    ``width``) scans. A faiss result may have dropped rows tied with its last one; asked for more
    than ``k``, a result whose last row is worse than its ``k``-th (or padding: everything was
    returned) holds every row tied with the ``k``-th, so the width grows until it does."""
    width = k + 1
    while True:
        distances, ids = search(width)
        last_real = ids[:, -1] >= 0
        if not (last_real & (distances[:, -1] == distances[:, k - 1])).any():
            return best_first(distances, ids, k, keep_max)
        width *= 2


class RunningTopK:
    """The best ``k`` (distance, id) pairs per query seen so far; ``keep_max`` for similarities.
    Fed exact slices (:func:`exact_top`), it holds the exact best ``k`` of every row offered."""

    def __init__(self, num_queries: int, k: int, keep_max: bool) -> None:
        self._k = k
        self._keep_max = keep_max
        worst = _WORST_SIMILARITY if keep_max else _WORST_DISTANCE
        self._distances = np.full((num_queries, k), worst, dtype=np.float32)
        self._ids = np.full((num_queries, k), -1, dtype=np.int64)

    def add(self, distances: np.ndarray, ids: np.ndarray) -> None:
        """Offer one slice's results, shape (num_queries, any width)."""
        merged_distances = np.concatenate([self._distances, np.asarray(distances, dtype=np.float32)], axis=1)
        merged_ids = np.concatenate([self._ids, np.asarray(ids, dtype=np.int64)], axis=1)
        self._distances, self._ids = best_first(merged_distances, merged_ids, self._k, self._keep_max)

    def sorted(self) -> tuple[np.ndarray, np.ndarray]:
        """A sorted copy (best first, ``-1`` ids padding)."""
        return self._distances.copy(), self._ids.copy()
