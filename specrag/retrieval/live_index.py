"""What a live corpus needs from the index: rows added while searches run, rows hidden, BM25 for both.

A built index is the base; documents added or replaced later get new rows appended to it (a row
names exactly one version of one document, and never changes), and a replaced or deleted
document's rows are hidden. What a search sees is one immutable :class:`Visibility`, swapped in
whole by :meth:`~specrag.retrieval.vector_index.VectorIndex.apply_changes`: a query reads it once
at its start, so it sees each document in one version, the old or the new, never both or neither.

- Dense channel: an IVF index adds the new vectors to the lists of their nearest centroids
  (:meth:`~specrag.retrieval.staged_ivf.StagedIVF.add`), an HNSW index inserts them into its graph
  (:meth:`~specrag.retrieval.staged_hnsw.StagedHNSW.add`); every stage of a staged search drops
  hidden rows, and reads deeper than ``k`` while any row is hidden so that ``k`` visible rows remain.
- Lexical channel: the base BM25 matrix is precomputed per document and cannot take documents,
  so added documents are scored by :class:`AddedLexical`, a small inverted index that uses the
  base's document frequencies (plus its own) and Lucene's BM25, and the two rankings are merged
  by score; hidden rows are dropped from both.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.lexical import BM25_PARAMETERS, LexicalIndex

__all__ = ["AddedLexical", "Growable", "ReadWriteLock", "Retrainable", "Visibility", "merge_rankings"]


class ReadWriteLock:
    """Many readers or one writer: searches read an index's lists together, an add moves them alone.

    A waiting writer stops new readers from entering, so a steady stream of searches cannot starve
    the updates (and an update waits for at most the stages in flight).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._condition:
            while self._writing or self._writers_waiting:
                self._condition.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._condition:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._condition.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()


@runtime_checkable
class Growable(Protocol):
    """A searcher that takes vectors while it serves and drops hidden rows when compacted."""

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Add ``vectors`` as rows ``first_row``, ``first_row + 1``, ..."""
        ...

    def compacted(self, keep: np.ndarray) -> Growable:
        """A new searcher holding only the rows ``r`` with ``keep[r]``, under the same row numbers."""
        ...

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows kept and their vectors as stored."""
        ...


@runtime_checkable
class Retrainable(Growable, Protocol):
    """A growable searcher whose centroids, trained at build, can be trained anew on its rows.

    Only an IVF index has centroids: added vectors go to the lists of the build's centroids, and
    once they drift away from them a live corpus trains new ones. A graph (HNSW) places each
    added vector among its own nearest neighbours, so it has nothing to drift from.
    """

    def retrained(self, keep: np.ndarray, seed: int = 0) -> Retrainable:
        """As :meth:`compacted`, its centroids trained anew on the rows kept."""
        ...

    def centroid_distance(self, vectors: np.ndarray) -> np.ndarray:
        """How far each vector lies from its nearest centroid (drift shows here)."""
        ...


@dataclass(frozen=True)
class Visibility:
    """Which index rows a search may return, as one immutable snapshot.

    ``row_to_passage[r]`` is the passage (document row) index row ``r`` stands for, ``-1`` when it
    is hidden (its document was replaced or deleted, or it is not published yet); a trailing
    ``-1`` maps padding ids (-1) to -1. ``hidden`` counts the hidden rows: while it is 0 a search
    reads exactly as deep as it did before the corpus went live.
    """

    row_to_passage: np.ndarray
    hidden: int

    @property
    def visible(self) -> np.ndarray:
        """Which index rows a search may return (one flag a row)."""
        return np.asarray(self.row_to_passage[:-1] >= 0)

    def passages(self, rows: np.ndarray) -> np.ndarray:
        """The passage each index row stands for (same shape), ``-1`` for padding, hidden rows and
        rows added after this snapshot was taken (a search may meet them in the lists)."""
        mapping = self.row_to_passage
        indices = np.asarray(rows, dtype=np.int64)
        return mapping[np.where((indices >= 0) & (indices < len(mapping) - 1), indices, len(mapping) - 1)]

    def alive(self, passages: np.ndarray) -> np.ndarray:
        """Which of ``passages`` (document rows, as the lexical channel names them) are visible."""
        rows = np.asarray(passages, dtype=np.int64)
        inside = (rows >= 0) & (rows < len(self.row_to_passage) - 1)
        visible = np.zeros(len(rows), dtype=bool)
        visible[inside] = self.row_to_passage[rows[inside]] == rows[inside]
        return visible

    def changed(self, added: Sequence[int], retired: Sequence[int]) -> Visibility:
        """A new snapshot: rows ``added`` (appended, each its own passage) visible, every row of
        the passages ``retired`` hidden."""
        mapping = self.row_to_passage[:-1]
        grown = len(mapping) + len(added)
        if list(added) != list(range(len(mapping), grown)):
            raise InvalidInputError(f"added rows must continue the index at row {len(mapping)}, got {added}")
        updated = np.concatenate([mapping, np.asarray(added, dtype=np.int64), [-1]])
        if len(retired):
            hit = np.isin(updated, np.asarray(retired, dtype=np.int64))
            hit[-1] = False
            updated[hit] = -1
        return Visibility(updated, int(np.count_nonzero(updated[:-1] < 0)))


def merge_rankings(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray], depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``depth`` of two (rows, scores) rankings, by score, ties to the lower row."""
    rows = np.concatenate([first[0], second[0]]).astype(np.int64)
    scores = np.concatenate([first[1], second[1]]).astype(np.float32)
    order = np.lexsort((rows, -scores))[:depth]
    return rows[order], scores[order]


class AddedLexical:
    """BM25 (Lucene's formula, the base's parameters) over the documents added to a live index.

    A term's document frequency counts the base's documents and the added ones, so an added
    document scores as it would in a rebuilt index up to the average document length, which is
    the added documents' own (the base's is not kept by ``bm25s``): rankings that RRF then fuses
    by rank, not by score.
    """

    def __init__(self, base: LexicalIndex) -> None:
        self._base = base
        self._postings: defaultdict[str, dict[int, int]] = defaultdict(dict)
        self._lengths: dict[int, int] = {}
        self._total_length = 0
        self._base_frequency: dict[str, int] | None = (
            None  # read on the first add: most indexes never take one
        )

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, row: int, text: str) -> None:
        """Index document row ``row``'s text (normalised as the corpus was)."""
        if self._base_frequency is None:
            self._base_frequency = self._base.document_frequencies()
        counts = Counter(self._base.terms(text))
        for term, count in counts.items():
            self._postings[term][row] = count
        length = sum(counts.values())
        self._lengths[row] = length
        self._total_length += length

    def search(self, terms: Sequence[str], depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The (at most) ``depth`` best added rows for query ``terms``: (rows, scores), best first."""
        if not self._lengths:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        k1, b = float(BM25_PARAMETERS["k1"]), float(BM25_PARAMETERS["b"])
        documents = self._base.num_passages + len(self._lengths)
        average = max(self._total_length / len(self._lengths), 1.0)
        scores: defaultdict[int, float] = defaultdict(float)
        for term, repeats in Counter(terms).items():
            postings = self._postings.get(term)
            if not postings:
                continue
            assert self._base_frequency is not None  # postings exist, so an add read it
            frequency = self._base_frequency.get(term, 0) + len(postings)
            idf = math.log(1 + (documents - frequency + 0.5) / (frequency + 0.5))
            for row, count in postings.items():
                norm = count + k1 * (1 - b + b * self._lengths[row] / average)
                scores[row] += repeats * idf * count * (k1 + 1) / norm
        if not scores:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        rows = np.fromiter(scores.keys(), dtype=np.int64, count=len(scores))
        values = np.fromiter(scores.values(), dtype=np.float32, count=len(scores))
        order = np.lexsort((rows, -values))[:depth]
        return rows[order], values[order]
