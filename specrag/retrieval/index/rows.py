"""Which passage each index row stands for, and the live changes that add rows and hide others.

Row i of the index is passage i of the corpus it was built from. A padded index (see
:mod:`specrag.retrieval.synthetic`) has more rows than passages; each extra row maps to the real
passage it was drawn around, so a caller never sees a row id that is not a passage (several rows
may name one passage).

A live corpus (:mod:`specrag.retrieval.live_index`) appends rows and hides others while searches
run; each search reads which rows are visible once, at its start, so all its stages and both
channels see the corpus in one state. A change is checked and worked out first
(:meth:`PassageRows.prepare`, before the live corpus logs it), then applied
(:meth:`PassageRows.apply`) in steps that each skip what they already did, so an apply cut short
by a failure is completed by running it again, without a row twice or out of place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.live_index import AddedLexical, Growable, Visibility

__all__ = ["PassageRows", "PreparedChanges", "visible_top"]


@dataclass(frozen=True)
class PreparedChanges:
    """One change to an index, checked and worked out before it is logged: rows ``first_row``,
    ``first_row + 1``, ... for ``ids`` (their ``vectors``, and each text's term counts for the
    lexical channel, empty without one), and the passages ``retired``."""

    ids: tuple[str, ...]
    vectors: np.ndarray
    terms: tuple[dict[str, int], ...]
    retired: tuple[int, ...]
    first_row: int

    @property
    def rows(self) -> range:
        """The rows the change adds."""
        return range(self.first_row, self.first_row + len(self.ids))


class PassageRows:
    """The passages of an index's ``num_rows`` rows: ``passage_ids``, then one synthetic row per
    ``synthetic_sources`` entry (the passage it stands for); with ``lexical``, the added
    documents' BM25 beside it."""

    def __init__(
        self,
        num_rows: int,
        passage_ids: Sequence[str],
        synthetic_sources: np.ndarray | None,
        lexical: LexicalIndex | None,
    ) -> None:
        extra = num_rows - len(passage_ids)
        sources = (
            np.zeros(0, dtype=np.int64) if synthetic_sources is None else synthetic_sources.astype(np.int64)
        )
        if len(sources) != extra or (extra and not 0 <= sources.min() <= sources.max() < len(passage_ids)):
            raise InvalidInputError(
                f"{num_rows} rows need {len(passage_ids)} passages plus {extra} synthetic rows "
                f"mapped to them, got {len(sources)} mappings"
            )
        if lexical is not None and lexical.num_passages != len(passage_ids):
            raise InvalidInputError(
                f"the lexical index has {lexical.num_passages} passages, the index {len(passage_ids)}"
            )
        self.passage_ids = list(passage_ids)
        self.synthetic_sources = sources
        # Row -> passage, with a trailing -1 so that padding ids (-1) map to -1 by plain indexing,
        # and the added documents' BM25; replaced as a whole when the corpus changes (apply).
        self.visibility = Visibility(
            np.concatenate([np.arange(len(passage_ids)), sources, [-1]]),
            0,
            AddedLexical(lexical) if lexical is not None else None,
        )
        # The rows a search may meet: the visibility's, and while apply adds, the new ones the
        # searcher holds before their visibility is swapped in.
        self._rows_held = len(self.visibility.row_to_passage) - 1

    def passages(self, row_ids: np.ndarray, visibility: Visibility | None = None) -> np.ndarray:
        """Corpus positions of index rows (same shape); ``-1`` stays ``-1``, and so do hidden rows
        (of replaced or deleted documents) as ``visibility`` (default: the current one) has them."""
        rows = np.asarray(row_ids, dtype=np.int64)
        # Rows of an add in progress map to no passage, like any row added after a search began.
        known = self._rows_held
        if rows.size and (rows.min() < -1 or rows.max() >= known):
            raise InvalidInputError(f"row ids outside [-1, {known})")
        return (visibility or self.visibility).passages(rows)

    def prepare(
        self,
        ids: Sequence[str],
        vectors: np.ndarray,
        texts: Sequence[str],
        retired: Sequence[int],
        searcher: Growable | None,
        dim: int,
    ) -> PreparedChanges:
        """Check a change and do the work of it that can fail on its input (the vectors' shape and
        values, the rows, each text's terms) without changing anything. ``searcher`` takes the
        rows (the caller has checked it can when there are any)."""
        if not len(ids) == len(vectors) == len(texts):
            raise InvalidInputError(f"{len(ids)} ids, {len(vectors)} vectors and {len(texts)} texts")
        current = self.visibility
        start = len(current.row_to_passage) - 1
        matrix = np.zeros((0, dim), dtype=np.float32)
        if len(ids):
            assert searcher is not None, "the index checks that its searcher takes rows"
            matrix = np.ascontiguousarray(vectors, dtype=np.float32)
            if matrix.ndim != 2 or matrix.shape[1] != dim:
                raise InvalidInputError(f"expected vectors of dimension {dim}, got shape {matrix.shape}")
            if not np.isfinite(matrix).all():
                raise InvalidInputError("document vectors contain NaN or infinite values")
            if searcher.next_row != start or len(self.passage_ids) != start:
                raise ArtifactError(
                    f"the index shows {start} rows but its searcher holds rows up to "
                    f"{searcher.next_row} and it names {len(self.passage_ids)}: a change is half applied"
                )
        end = start + len(ids)  # a replay retires rows it adds itself
        outside = [row for row in retired if not 0 <= row < end]
        if outside:
            raise InvalidInputError(f"retired rows {outside} outside the index's [0, {end})")
        lexical = current.lexical
        terms = tuple(lexical.counted(text) for text in texts) if lexical is not None else ()
        return PreparedChanges(tuple(ids), matrix, terms, tuple(int(row) for row in retired), start)

    def apply(self, change: PreparedChanges, searcher: Growable | None) -> list[int]:
        """Apply a prepared change: ``searcher``'s rows, the rows' ids, then one swap of the
        visibility and the lexical channel with it; returns the new rows.

        Each step skips what it holds already, so after a failure part-way, running the same
        change again completes it, and running a completed one again changes nothing.
        """
        rows = change.rows
        current = self.visibility
        shown = len(current.row_to_passage) - 1
        if len(rows) and shown == rows.stop:  # swapped in already
            return list(rows)
        if shown != rows.start:
            raise InvalidInputError(f"the change adds rows from {rows.start}, the index shows {shown} rows")
        if len(rows):
            assert searcher is not None, "the index checks that its searcher takes rows"
            self._rows_held = max(self._rows_held, rows.stop)  # a search may meet them from now on
            held = searcher.next_row
            if not rows.start <= held <= rows.stop:
                raise ArtifactError(f"the searcher holds rows up to {held}, the change adds rows {rows}")
            if held < rows.stop:
                searcher.add(change.vectors[held - rows.start :], held)
            named = len(self.passage_ids) - rows.start  # row -> id; an id's current row is the corpus's
            self.passage_ids.extend(change.ids[named:])
        lexical = current.lexical
        if lexical is not None:
            lexical = lexical.changed(dict(zip(rows, change.terms, strict=True)), change.retired)
        self.visibility = replace(current.changed(list(rows), change.retired), lexical=lexical)
        return list(rows)


def visible_top(
    distances: np.ndarray, ids: np.ndarray, k: int, visibility: Visibility
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` rows of each query's result that ``visibility`` shows, padded as faiss pads."""
    newer = ids.size and ids.max() >= len(visibility.row_to_passage) - 1  # added since it started
    if not visibility.hidden and not newer:
        return distances, ids
    visible = visibility.passages(ids) >= 0
    kept_ids = np.full((len(ids), k), -1, dtype=np.int64)
    kept_distances = np.full((len(ids), k), -np.finfo(np.float32).max, dtype=np.float32)
    for query, mask in enumerate(visible):
        chosen = np.flatnonzero(mask)[:k]
        kept_ids[query, : len(chosen)] = ids[query, chosen]
        kept_distances[query, : len(chosen)] = distances[query, chosen]
    return kept_distances, kept_ids
