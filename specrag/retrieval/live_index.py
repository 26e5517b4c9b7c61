"""What a live corpus needs from the index: rows added while searches run, rows hidden, BM25 for both.

A built index is the base; documents added or replaced later get new rows appended to it (a row
names exactly one version of one document, and never changes), and a replaced or deleted
document's rows are hidden. What a search sees is one immutable :class:`Visibility`, swapped in
whole by :meth:`~specrag.retrieval.vector_index.VectorIndex.apply_changes`: a query reads it once
at its start, so it sees each document in one version, the old or the new, never both or neither.
Nothing a search reads is changed in place: the added documents' BM25 is part of the snapshot, and
the searchers' lists and graphs are moved under their own read-write locks.

- Dense channel: an IVF index adds the new vectors to the lists of their nearest centroids
  (:meth:`~specrag.retrieval.backends.local.staged_ivf.StagedIVF.add`), an HNSW index inserts them into its
  graph (:meth:`~specrag.retrieval.backends.local.staged_hnsw.StagedHNSW.add`). Every stage of a search skips
  hidden rows at the source (a faiss ``IDSelectorBitmap`` over :attr:`Visibility.bitmap`, the same bits
  in the HNSW kernel, which still walks through them), so however many old versions of a
  document lie near a query, ``k`` visible rows remain.
- Lexical channel: the base BM25 matrix is precomputed per document and cannot take documents,
  so added documents are scored by :class:`AddedLexical`, a small inverted index that uses the
  base's document frequencies (plus its own) and Lucene's BM25, and the two rankings are merged
  by score. A retired row leaves :class:`AddedLexical` in the same swap that hides it, and the base's
  hidden rows are skipped before its ranking is cut, so old versions never crowd a ranking out.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import faiss
import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.lexical.bm25 import BM25_PARAMETERS, LexicalIndex

__all__ = [
    "AddedLexical",
    "Growable",
    "ReadWriteLock",
    "Retrainable",
    "Visibility",
    "bitmap_selector",
    "merge_rankings",
]


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
    """A searcher that takes vectors while it serves, skips hidden rows in its searches and drops
    them when compacted."""

    @property
    def next_row(self) -> int:
        """The row the next :meth:`add` must start at: how far the rows it holds reach."""
        ...

    def add(self, vectors: np.ndarray, first_row: int) -> None:
        """Add ``vectors`` as rows ``first_row`` (:attr:`next_row`), ``first_row + 1``, ..."""
        ...

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One-shot search returning only rows ``visibility`` shows (None: every row held)."""
        ...

    def stages(
        self, queries: np.ndarray, k: int, plan: Any, visibility: Visibility | None = None
    ) -> Iterator[Any]:
        """Staged search returning only rows ``visibility`` shows; the last stage equals :meth:`search`."""
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
    runs exactly as it did before the corpus went live. ``lexical`` is the added documents' BM25
    as of this snapshot (None without a lexical channel).
    """

    row_to_passage: np.ndarray
    hidden: int
    lexical: AddedLexical | None = None

    @cached_property
    def visible(self) -> np.ndarray:
        """Which index rows a search may return (one flag a row)."""
        return np.asarray(self.row_to_passage[:-1] >= 0)

    @cached_property
    def bitmap(self) -> np.ndarray:
        """:attr:`visible` packed as faiss's ``IDSelectorBitmap`` reads it (bit ``r % 8`` of byte
        ``r // 8``); rows past it (added after this snapshot) read as hidden."""
        return np.packbits(self.visible, bitorder="little")

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
        return Visibility(updated, int(np.count_nonzero(updated[:-1] < 0)), self.lexical)


def bitmap_selector(bitmap: np.ndarray) -> Any:
    """A faiss selector of the ids whose bit is set in ``bitmap`` (which the caller keeps alive)."""
    return faiss.IDSelectorBitmap(len(bitmap), faiss.swig_ptr(bitmap))


def merge_rankings(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray], depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``depth`` of two (rows, scores) rankings, by score, ties to the lower row."""
    rows = np.concatenate([first[0], second[0]]).astype(np.int64)
    scores = np.concatenate([first[1], second[1]]).astype(np.float32)
    order = np.lexsort((rows, -scores))[:depth]
    return rows[order], scores[order]


class AddedLexical:
    """BM25 (Lucene's formula, the base's parameters) over the live documents added to an index.

    A term's document frequency counts the base's documents and the added ones, so an added
    document scores as it would in a rebuilt index up to the average document length, which is
    the added documents' own (the base's is not kept by ``bm25s``): rankings that RRF then fuses
    by rank, not by score.

    Immutable once made: :meth:`changed` makes the next one, sharing the postings it does not
    touch, and the index swaps it in with the :class:`Visibility` it belongs to, so a search never
    reads postings a writer is changing. A retired row's postings go in that change: only the
    current versions are scored, however often a document was replaced.
    """

    def __init__(
        self,
        base: LexicalIndex,
        base_frequency: dict[str, int] | None = None,
        postings: dict[str, dict[int, int]] | None = None,
        documents: dict[int, dict[str, int]] | None = None,
        lengths: dict[int, int] | None = None,
    ) -> None:
        self._base = base
        # Read on the first count (most indexes never take a document), then shared by every successor.
        self._base_frequency = base_frequency
        self._postings = postings if postings is not None else {}
        self._documents = documents if documents is not None else {}  # row -> its term counts
        self._lengths = lengths if lengths is not None else {}  # row -> its number of terms
        self._total_length = sum(self._lengths.values())

    def __len__(self) -> int:
        return len(self._documents)

    def counted(self, text: str) -> dict[str, int]:
        """The term counts of a document's text (normalised as the corpus was): the work that can
        fail, done before a change is logged so that :meth:`changed` only files them."""
        if self._base_frequency is None:
            self._base_frequency = self._base.document_frequencies()
        return dict(Counter(self._base.terms(text)))

    def changed(self, added: Mapping[int, Mapping[str, int]], retired: Iterable[int]) -> AddedLexical:
        """A new index: the rows ``added`` (with their :meth:`counted` terms) in, then the rows
        ``retired`` out. Rows already in, or already out, stay so: a change applied twice is
        applied once."""
        postings = dict(self._postings)
        documents = dict(self._documents)
        lengths = dict(self._lengths)
        copied: set[str] = set()

        def own(term: str) -> dict[int, int]:
            """The term's postings, copied on first write (the old index's stay as they were)."""
            if term not in copied:
                postings[term] = dict(postings.get(term, {}))
                copied.add(term)
            return postings[term]

        for row, counts in added.items():
            if row in documents:
                continue
            for term, count in counts.items():
                own(term)[row] = count
            documents[row] = dict(counts)
            lengths[row] = sum(counts.values())
        for row in retired:  # after the rows added: a replay retires some of its own
            gone = documents.pop(row, None)
            if gone is None:  # a base row, or one removed already
                continue
            for term in gone:
                own(term).pop(row, None)
            del lengths[row]
        for term in copied:
            if not postings[term]:
                del postings[term]
        return AddedLexical(self._base, self._base_frequency, postings, documents, lengths)

    def search(self, terms: Sequence[str], depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The (at most) ``depth`` best added rows for query ``terms``: (rows, scores), best first."""
        if not self._documents:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        k1, b = float(BM25_PARAMETERS["k1"]), float(BM25_PARAMETERS["b"])
        documents = self._base.num_passages + len(self._documents)
        average = max(self._total_length / len(self._documents), 1.0)
        scores: defaultdict[int, float] = defaultdict(float)
        for term, repeats in Counter(terms).items():
            postings = self._postings.get(term)
            if not postings:
                continue
            assert self._base_frequency is not None  # postings exist, so a count read it
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
