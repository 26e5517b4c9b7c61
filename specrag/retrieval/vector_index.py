"""The searchable index the controller holds: a staged searcher plus the row → passage mapping.

Row i of the index is passage i of the corpus it was built from. A padded index (see
:mod:`specrag.retrieval.synthetic`) has more rows than passages; each extra row maps to the real
passage it was drawn around, and :meth:`VectorIndex.passage_index_of` applies that mapping so
the caller never sees a row id that is not a passage (several rows may name one passage).

An index built with a lexical channel (:mod:`specrag.retrieval.lexical.bm25`) searches hybrid when
it is given the query's text: BM25 runs first, in the search thread, before the first dense stage
(a small fraction of the dense search's time, docs/retrieval.md), and every stage's running top-k is the
reciprocal-rank fusion (:mod:`specrag.retrieval.lexical.fusion`) of that fixed lexical ranking with the
dense running top-k. The running top-k that speculation prefills is therefore already the hybrid
one, and the last stage equals :meth:`VectorIndex.search` given the text. A searcher that ranks
query texts itself (:class:`RanksText`: a database's full-text search, in the snapshot its stages
read) gives the lexical ranking in place of BM25's, with its first stage; it is fused the same
way. Fused stages name passages: their ids are passage positions (real rows) and their
``distances`` are fused scores, higher first.

A live corpus (:mod:`specrag.retrieval.live_index`) appends rows and hides others while searches
run (:meth:`VectorIndex.apply_changes`); each search reads which rows are visible once, at its
start, so all its stages and both channels see the corpus in one state. A change is checked and
worked out first (:meth:`VectorIndex.prepare_changes`, before the live corpus logs it), then
applied (:meth:`VectorIndex.apply_prepared`) in steps that each skip what they already did, so an
apply cut short by a failure is completed by running it again, without a row twice or out of place.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.backends.shards.merge import ShardAnswers, ShardedSearcher
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.lexical.fusion import FusionConfig, distinct_in_order, fuse
from specrag.retrieval.lexical.identifiers import named_identifiers
from specrag.retrieval.live_index import AddedLexical, Growable, Retrainable, Visibility, merge_rankings
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stage_stats import PlanKey, StageOutlook, StageStatistics
from specrag.retrieval.search.stages import (
    StagedSearcher,
    StagePlan,
    StageResult,
    prepare_queries,
    stage_plan,
)
from specrag.retrieval.text import normalize_text

__all__ = ["PreparedChanges", "RanksText", "StagedSearch", "VectorIndex"]


@runtime_checkable
class RanksText(Protocol):
    """A searcher that ranks its rows by a query's words itself, in the same read of its rows as
    its vector search (a database's full-text search in the stages' snapshot), when
    ``ranks_text``: the index then fuses that ranking instead of its own BM25's. Rankings are
    rows best first, ``depth`` per query, padded with ``-1``."""

    ranks_text: bool

    def search_text(
        self, queries: np.ndarray, k: int, texts: Sequence[str], depth: int, visibility: Visibility
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores, rows, each query's ranking by its text)."""
        ...

    def stages_text(
        self,
        queries: np.ndarray,
        k: int,
        texts: Sequence[str],
        depth: int,
        plan: StagePlan,
        visibility: Visibility,
    ) -> Iterator[tuple[StageResult, np.ndarray | None]]:
        """Each stage, with the rankings by text when they came with it (the first stage always)."""
        ...


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


class VectorIndex:
    """Staged search by vector, one query or a batch, synchronously or on the event loop.

    ``k`` larger than the index gives ``-1`` ids (and faiss's neutral distance) in the slots
    that no row fills; an empty index or a query of the wrong dimension raises InvalidInputError.
    """

    def __init__(
        self,
        searcher: StagedSearcher,
        passage_ids: Sequence[str],
        synthetic_sources: np.ndarray | None = None,
        embedder: Embedder | None = None,
        runner: SearchRunner | None = None,
        lexical: LexicalIndex | None = None,
        fusion: FusionConfig | None = None,
        default_stages: int | None = None,
    ) -> None:
        extra = searcher.ntotal - len(passage_ids)
        sources = (
            np.zeros(0, dtype=np.int64) if synthetic_sources is None else synthetic_sources.astype(np.int64)
        )
        if len(sources) != extra or (extra and not 0 <= sources.min() <= sources.max() < len(passage_ids)):
            raise InvalidInputError(
                f"{searcher.ntotal} rows need {len(passage_ids)} passages plus {extra} synthetic rows "
                f"mapped to them, got {len(sources)} mappings"
            )
        if lexical is not None and lexical.num_passages != len(passage_ids):
            raise InvalidInputError(
                f"the lexical index has {lexical.num_passages} passages, the index {len(passage_ids)}"
            )
        self.searcher = searcher
        self._default_stages = default_stages  # for a searcher of a kind with no default (a test's)
        self.lexical = lexical
        self.fusion = fusion or FusionConfig()
        self.passage_ids = list(passage_ids)
        self.synthetic_sources = sources
        self.embedder = embedder
        self._runner = runner
        # How each stage's top-k turned out, learned from every single-query staged search.
        self._stage_stats = StageStatistics()
        # Row -> passage, with a trailing -1 so that padding ids (-1) map to -1 by plain indexing,
        # and the added documents' BM25; replaced as a whole when the corpus changes (apply_changes).
        self._visibility = Visibility(
            np.concatenate([np.arange(len(passage_ids)), sources, [-1]]),
            0,
            AddedLexical(lexical) if lexical is not None else None,
        )
        # The rows a search may meet: the visibility's, and while apply_changes adds, the new ones
        # the searcher holds before their visibility is swapped in.
        self._rows_held = len(self._visibility.row_to_passage) - 1

    @property
    def dim(self) -> int:
        return self.searcher.dim

    def stage_plan(
        self, num_stages: int | None = None, schedule: str | None = None, stage_budget_s: float | None = None
    ) -> StagePlan:
        """How a staged search of this index is cut: the given settings, the index kind's defaults
        for the rest (:func:`~specrag.retrieval.search.stages.stage_plan`); ``stage_budget_s`` instead
        cuts stages by time."""
        if stage_budget_s is not None:
            return StagePlan.budget(stage_budget_s)
        return stage_plan(self.searcher.kind, num_stages, schedule, self._default_stages)

    @property
    def default_stages(self) -> int:
        """Stages a staged search of this index is cut into unless told (its kind's default)."""
        return self.stage_plan().num_stages

    @property
    def hybrid(self) -> bool:
        """Whether searches given the query's text fuse a lexical channel with the dense one."""
        return self.lexical is not None or self._ranks_text

    @property
    def _ranks_text(self) -> bool:
        """Whether the searcher ranks query texts itself (:class:`RanksText`)."""
        return isinstance(self.searcher, RanksText) and self.searcher.ranks_text

    @property
    def runner(self) -> SearchRunner:
        """The thread pool async searches use (one unpinned worker unless one was given)."""
        if self._runner is None:
            self._runner = SearchRunner()
        return self._runner

    def use_runner(self, runner: SearchRunner) -> None:
        """Run async searches on ``runner`` (e.g. pinned to cores apart from the LLM engine)."""
        self._runner = runner

    def passage_index_of(self, row_ids: np.ndarray, visibility: Visibility | None = None) -> np.ndarray:
        """Corpus positions of index rows (same shape); ``-1`` stays ``-1``, and so do hidden rows
        (of replaced or deleted documents) as ``visibility`` (default: the current one) has them."""
        rows = np.asarray(row_ids, dtype=np.int64)
        # Rows of an add in progress map to no passage, like any row added after a search began.
        known = self._rows_held
        if rows.size and (rows.min() < -1 or rows.max() >= known):
            raise InvalidInputError(f"row ids outside [-1, {known})")
        return (visibility or self._visibility).passages(rows)

    def apply_changes(
        self, ids: Sequence[str], vectors: np.ndarray, texts: Sequence[str], retired: Sequence[int]
    ) -> list[int]:
        """Append one row per document (its id, vector and text, normalised, for the lexical
        channel) and hide the rows of the passages ``retired``, visible to searches that start
        after the call returns, all at once; returns the new rows.

        :meth:`prepare_changes` then :meth:`apply_prepared`: a caller that logs the change
        (:mod:`specrag.pipeline.store.live_corpus`) does so between the two. The caller makes one
        change at a time. New rows are passages of their own, so the index must not be padded.
        """
        return self.apply_prepared(self.prepare_changes(ids, vectors, texts, retired))

    def prepare_changes(
        self, ids: Sequence[str], vectors: np.ndarray, texts: Sequence[str], retired: Sequence[int]
    ) -> PreparedChanges:
        """Check a change and do the work of it that can fail on its input (the vectors' shape and
        values, the rows, each text's terms) without changing anything: InvalidInputError says
        what is wrong, before the caller commits to the change."""
        if not len(ids) == len(vectors) == len(texts):
            raise InvalidInputError(f"{len(ids)} ids, {len(vectors)} vectors and {len(texts)} texts")
        current = self._visibility
        start = len(current.row_to_passage) - 1
        matrix = np.zeros((0, self.dim), dtype=np.float32)
        if len(ids):
            self.check_growable()
            assert isinstance(self.searcher, Growable)
            matrix = np.ascontiguousarray(vectors, dtype=np.float32)
            if matrix.ndim != 2 or matrix.shape[1] != self.dim:
                raise InvalidInputError(f"expected vectors of dimension {self.dim}, got shape {matrix.shape}")
            if not np.isfinite(matrix).all():
                raise InvalidInputError("document vectors contain NaN or infinite values")
            if self.searcher.next_row != start or len(self.passage_ids) != start:
                raise ArtifactError(
                    f"the index shows {start} rows but its searcher holds rows up to "
                    f"{self.searcher.next_row} and it names {len(self.passage_ids)}: a change is half applied"
                )
        end = start + len(ids)  # a replay retires rows it adds itself
        outside = [row for row in retired if not 0 <= row < end]
        if outside:
            raise InvalidInputError(f"retired rows {outside} outside the index's [0, {end})")
        lexical = current.lexical
        terms = tuple(lexical.counted(text) for text in texts) if lexical is not None else ()
        return PreparedChanges(tuple(ids), matrix, terms, tuple(int(row) for row in retired), start)

    def apply_prepared(self, change: PreparedChanges) -> list[int]:
        """Apply a prepared change: the searcher's rows, the rows' ids, then one swap of the
        visibility and the lexical channel with it; returns the new rows.

        Each step skips what it holds already, so after a failure part-way, running the same
        change again completes it, and running a completed one again changes nothing.
        """
        rows = change.rows
        current = self._visibility
        shown = len(current.row_to_passage) - 1
        if len(rows) and shown == rows.stop:  # swapped in already
            return list(rows)
        if shown != rows.start:
            raise InvalidInputError(f"the change adds rows from {rows.start}, the index shows {shown} rows")
        if len(rows):
            searcher = self.searcher
            assert isinstance(searcher, Growable)
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
        self._visibility = replace(current.changed(list(rows), change.retired), lexical=lexical)
        return list(rows)

    def check_growable(self) -> None:
        """Raise InvalidInputError unless this index can take new documents while it serves."""
        if not isinstance(self.searcher, Growable):
            raise InvalidInputError(
                f"a {self.searcher.kind} index cannot take documents while it serves: "
                "build an IVF or HNSW index"
            )
        if len(self.synthetic_sources):
            raise InvalidInputError("a padded index (synthetic rows) cannot take documents")

    @property
    def visible_rows(self) -> np.ndarray:
        """Which index rows searches may return now (one flag a row)."""
        return self._visibility.visible

    @property
    def removable_rows(self) -> int:
        """Hidden rows the searcher still holds (and scans): what :meth:`compact` drops."""
        return self.searcher.ntotal - int(np.count_nonzero(self._visibility.visible))

    def compact(self, retrain: bool = False) -> int:
        """Swap in a searcher without the hidden rows (searches in flight finish on the old one),
        with centroids trained anew on the rows kept when ``retrain`` (an IVF index's: an HNSW
        graph has none); returns the rows dropped. The caller keeps changes out while it runs
        (one writer)."""
        searcher = self.searcher
        if not isinstance(searcher, Growable):
            raise InvalidInputError(f"a {searcher.kind} index cannot be compacted while it serves")
        visible = self._visibility.visible
        if searcher.next_row != len(visible):
            raise InvalidInputError("a change is half applied: apply it again before compacting")
        dropped = self.removable_rows
        replacement: Growable
        if not retrain:
            replacement = searcher.compacted(visible)
        elif isinstance(searcher, Retrainable):
            replacement = searcher.retrained(visible)
        else:
            raise InvalidInputError(f"a {searcher.kind} index has no centroids to re-train")
        self.searcher = replacement  # type: ignore[assignment]
        return dropped

    @property
    def hidden_rows(self) -> int:
        """Rows of replaced or deleted documents that every search filters out (compaction's cue)."""
        return self._visibility.hidden

    def ranked_rows(self, row_ids: np.ndarray) -> tuple[int, ...]:
        """Corpus positions of a 1-D result in rank order, padding and repeats (synthetic rows) dropped."""
        return tuple(dict.fromkeys(row for row in self.passage_index_of(row_ids).tolist() if row >= 0))

    def passage_ids_of(self, row_ids: np.ndarray) -> list[str]:
        """Passage ids of a 1-D result, padding dropped, in rank order."""
        return [self.passage_ids[i] for i in self.passage_index_of(row_ids).tolist() if i >= 0]

    def embed_query(self, text: str) -> np.ndarray:
        """The query vector of ``text`` (normalised as the corpus was) with the index's embedder."""
        if self.embedder is None:
            raise InvalidInputError("this index has no embedder: search it by vector")
        vector: np.ndarray = self.embedder.embed([normalize_text(text)])[0]
        return vector

    def search(
        self,
        queries: np.ndarray,
        k: int,
        *,
        query_text: str | Sequence[str] | None = None,
        batch: bool = False,
        shard_answers: ShardAnswers | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One-shot search in the calling thread: (distances, ids), what the last stage of
        :meth:`search_staged` with the same arguments holds (``shard_answers`` as there).

        ``queries`` is one query vector (1-D results) or, with ``batch``, a matrix of them (one
        row per query). With ``query_text`` (one per query of a batch) and a lexical channel the
        search is hybrid: ids are passages and distances fused scores (see the module's docstring).
        """
        matrix = prepare_queries(self._shaped(queries, batch), self.dim, self.searcher.ntotal, k)
        visibility = self._visibility
        texts = self._texts(query_text, batch)
        if texts is not None and self._ranks_text:
            ids, distances = self._text_search(matrix, k, texts, visibility)
            return (distances, ids) if batch else (distances[0], ids[0])
        lexical = self._lexical_rankings(texts, len(matrix), visibility)
        if lexical is None:
            found = self._dense_search(matrix, self._depth(k, visibility), visibility, shard_answers)
            distances, ids = self._visible_top(*found, k, visibility)
        else:
            _, rows = self._dense_search(matrix, self.fusion.dense_depth(k), visibility, shard_answers)
            ids, distances = self._fused(lexical, rows, k, visibility)
        return (distances, ids) if batch else (distances[0], ids[0])

    def search_staged(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan | None = None,
        *,
        query_text: str | Sequence[str] | None = None,
        batch: bool = False,
        learn: bool = True,
        shard_answers: ShardAnswers | None = None,
    ) -> StagedSearch:
        """A staged search cut by ``plan`` (None: the index kind's, :meth:`stage_plan`), not started
        yet: ``for`` runs it in the calling thread, ``async for`` on the search threads.

        ``queries``, ``query_text`` and ``batch`` are as for :meth:`search`, whose result the last
        stage holds. A single query's search run on the search threads teaches
        the index's stage statistics, which its :meth:`StagedSearch.outlook` reads, unless
        ``learn`` is false (a measurement beside the service's searches that must not sway them).
        ``shard_answers`` (a sharded index) accepts a top-k missing the shards that fail, and
        records which answered (:class:`~specrag.retrieval.backends.shards.merge.ShardAnswers`).
        """
        matrix = prepare_queries(self._shaped(queries, batch), self.dim, self.searcher.ntotal, k)
        resolved = plan or self.stage_plan()

        def stages() -> Iterator[StageResult]:
            return self._stages(matrix, k, resolved, self._texts(query_text, batch), shard_answers)

        key = self._plan_key(k, resolved)
        return StagedSearch(self, stages, self._stage_stats, key, single=not batch, learn=learn)

    @staticmethod
    def _shaped(queries: np.ndarray, batch: bool) -> np.ndarray:
        """``queries`` as a batch; a single search must be given exactly one query vector."""
        if not batch and np.ndim(queries) != 1:
            raise InvalidInputError(
                f"expected one query vector, got shape {np.shape(queries)}; search a batch with batch=True"
            )
        return np.asarray(queries) if batch else np.asarray(queries)[None, :]

    @staticmethod
    def _texts(query_text: str | Sequence[str] | None, batch: bool) -> Sequence[str] | None:
        """The query texts as a sequence, one per query (a single search's text is one string)."""
        if query_text is None or batch:
            return query_text
        if not isinstance(query_text, str):
            raise InvalidInputError("a single query's text must be a string")
        return [query_text]

    def _depth(self, k: int, visibility: Visibility) -> int:
        """How deep a dense-only search reads for a top-k: k, or deeper while rows are hidden and
        the searcher cannot skip them itself."""
        skips = not visibility.hidden or isinstance(self.searcher, Growable)
        return k if skips else self.fusion.dense_depth(k)

    def _dense_search(
        self,
        matrix: np.ndarray,
        depth: int,
        visibility: Visibility,
        shard_answers: ShardAnswers | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The searcher's one-shot search, skipping hidden rows at the source when it can (a
        growable searcher): old versions then never crowd the current ones out of its top."""
        searcher = self.searcher
        if shard_answers is not None and isinstance(searcher, ShardedSearcher):
            return searcher.search(matrix, depth, visibility if visibility.hidden else None, shard_answers)
        if self._given_visibility(visibility) and isinstance(searcher, Growable):
            return searcher.search(matrix, depth, visibility)
        return searcher.search(matrix, depth)

    def _given_visibility(self, visibility: Visibility) -> bool:
        """Whether the searcher takes the search's visibility: a growable one while rows are hidden,
        and a database's always (``snapshot_rows``: its snapshot may hold a version committed
        after the visibility was read, which it shows as the version the visibility holds)."""
        return bool(visibility.hidden) or bool(getattr(self.searcher, "snapshot_rows", False))

    def _dense_stages(
        self,
        matrix: np.ndarray,
        depth: int,
        plan: StagePlan,
        visibility: Visibility,
        shard_answers: ShardAnswers | None,
    ) -> Iterator[StageResult]:
        """The searcher's stages, skipping hidden rows as :meth:`_dense_search` does."""
        searcher = self.searcher
        if shard_answers is not None and isinstance(searcher, ShardedSearcher):
            return searcher.stages(
                matrix, depth, plan, visibility if visibility.hidden else None, shard_answers
            )
        if self._given_visibility(visibility) and isinstance(searcher, Growable):
            return searcher.stages(matrix, depth, plan, visibility)
        return searcher.stages(matrix, depth, plan)

    @staticmethod
    def _visible_top(
        distances: np.ndarray, ids: np.ndarray, k: int, visibility: Visibility
    ) -> tuple[np.ndarray, np.ndarray]:
        """The first ``k`` visible rows of each query's result, padded as faiss pads."""
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

    def _lexical_ranking(self, text: str, visibility: Visibility) -> np.ndarray:
        """A query's lexical ranking of visible passages, the base's and the added documents' merged.

        Both skip hidden rows before they cut their ranking (the base by the visibility's flags,
        the added documents hold only their current versions), so each ranks ``depth`` visible ones.
        """
        added_lexical = visibility.lexical
        assert self.lexical is not None and added_lexical is not None
        depth, weight = self.fusion.depth, self.fusion.identifier_weight
        if not visibility.hidden and not len(added_lexical):
            return self.lexical.search(text, depth, weight)[0]
        allowed = visibility.visible if visibility.hidden else None
        base = self.lexical.search(text, depth, weight, allowed)
        added = added_lexical.search(self.lexical.query_terms(text, weight), depth)
        rows, _ = merge_rankings(base, added, depth)
        return rows[visibility.alive(rows)]

    def _lexical_rankings(
        self, texts: Sequence[str] | None, num_queries: int, visibility: Visibility
    ) -> list[tuple[np.ndarray, bool]] | None:
        """Each query's lexical ranking (passages) and whether it names an identifier, or None
        when the search is dense only."""
        if texts is None or self.lexical is None:
            return None
        checked = self._checked_texts(texts, num_queries)
        return [(self._lexical_ranking(text, visibility), bool(named_identifiers(text))) for text in checked]

    @staticmethod
    def _checked_texts(texts: Sequence[str], num_queries: int) -> Sequence[str]:
        """``texts``, refused unless they are strings, one per query."""
        if isinstance(texts, str) or len(texts) != num_queries:
            raise InvalidInputError(f"expected {num_queries} query texts, one per query vector")
        if not all(isinstance(text, str) for text in texts):
            raise InvalidInputError("query texts must be strings")
        return texts

    def _text_rankings(
        self, ranked: np.ndarray, texts: Sequence[str], visibility: Visibility
    ) -> list[tuple[np.ndarray, bool]]:
        """The searcher's rankings of rows by text (:class:`RanksText`) as the lexical rankings of
        passages that :meth:`_fused` takes."""
        passages = self.passage_index_of(ranked, visibility)
        return [
            (distinct_in_order(row), bool(named_identifiers(text)))
            for row, text in zip(passages, texts, strict=True)
        ]

    def _stages(
        self,
        matrix: np.ndarray,
        k: int,
        plan: StagePlan,
        texts: Sequence[str] | None,
        shard_answers: ShardAnswers | None = None,
    ) -> Iterator[StageResult]:
        """Dense stages, or, given texts and a lexical channel, each one fused with BM25's ranking.

        The lexical search runs before the first dense stage; its time is charged to that stage.
        """
        started = time.perf_counter()
        visibility = self._visibility
        if texts is not None and self._ranks_text:
            yield from self._text_stages(matrix, k, plan, texts, visibility)
            return
        lexical = self._lexical_rankings(texts, len(matrix), visibility)
        if lexical is None:
            for stage in self._dense_stages(
                matrix, self._depth(k, visibility), plan, visibility, shard_answers
            ):
                distances, ids = self._visible_top(stage.distances, stage.ids, k, visibility)
                yield StageResult(stage.stage, ids, distances, stage.done, stage.elapsed_s)
            return
        lexical_s = time.perf_counter() - started
        for stage in self._dense_stages(matrix, self.fusion.dense_depth(k), plan, visibility, shard_answers):
            ids, scores = self._fused(lexical, stage.ids, k, visibility)
            elapsed_s = stage.elapsed_s + (lexical_s if stage.stage == 1 else 0.0)
            yield StageResult(stage.stage, ids, scores, stage.done, elapsed_s)

    def _text_search(
        self, matrix: np.ndarray, k: int, texts: Sequence[str], visibility: Visibility
    ) -> tuple[np.ndarray, np.ndarray]:
        """The dense search fused with the searcher's own ranking by text: (passages, scores)."""
        assert isinstance(self.searcher, RanksText)
        checked = self._checked_texts(texts, len(matrix))
        depth = self.fusion.dense_depth(k)
        _, rows, ranked = self.searcher.search_text(matrix, depth, checked, self.fusion.depth, visibility)
        return self._fused(self._text_rankings(ranked, checked, visibility), rows, k, visibility)

    def _text_stages(
        self, matrix: np.ndarray, k: int, plan: StagePlan, texts: Sequence[str], visibility: Visibility
    ) -> Iterator[StageResult]:
        """Dense stages fused with the searcher's own ranking by text, which comes with the
        first stage to arrive (in the same snapshot as every stage)."""
        assert isinstance(self.searcher, RanksText)
        checked = self._checked_texts(texts, len(matrix))
        depth = self.fusion.dense_depth(k)
        staged = self.searcher.stages_text(matrix, depth, checked, self.fusion.depth, plan, visibility)
        lexical: list[tuple[np.ndarray, bool]] | None = None
        for stage, ranked in staged:
            if lexical is None:
                if ranked is None:
                    raise InvalidInputError("a stage came without the ranking by text before it")
                lexical = self._text_rankings(ranked, checked, visibility)
            ids, scores = self._fused(lexical, stage.ids, k, visibility)
            yield StageResult(stage.stage, ids, scores, stage.done, stage.elapsed_s)

    def _fused(
        self, lexical: Sequence[tuple[np.ndarray, bool]], rows: np.ndarray, k: int, visibility: Visibility
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each query's top-k passages and fused scores: its lexical ranking fused with its dense
        ``rows`` (one row per query)."""
        fused = [
            fuse(ranking, passages, k, self.fusion, names_identifier)
            for (ranking, names_identifier), passages in zip(
                lexical, self.passage_index_of(rows, visibility), strict=True
            )
        ]
        return np.stack([ids for ids, _ in fused]), np.stack([scores for _, scores in fused])

    def _plan_key(self, k: int, plan: StagePlan) -> PlanKey:
        """What the stage statistics keep a search's figures under: the searcher's settings, k and
        the stage plan."""
        settings = tuple(sorted((name, str(value)) for name, value in self.searcher.settings.items()))
        return PlanKey(settings, k, plan.num_stages, plan.schedule)


class StagedSearch:
    """One staged search of a :class:`VectorIndex`, made by :meth:`VectorIndex.search_staged`.

    Iterated with ``for``, its stages are computed in the calling thread (scripts, benchmarks);
    with ``async for``, on the index's search threads. Leaving an ``async for`` (use
    ``contextlib.aclosing`` on the search to make it immediate) or cancelling the task stops the
    search after the stage in flight.

    The index's stage statistics (:mod:`specrag.retrieval.search.stage_stats`) have one writer and one
    reader, both here: a single query's search on the search threads (the service's) records its
    stages once the last one is known, and :meth:`outlook` reads what the searches of the same plan
    taught, under the key of the plan the caller resolved. They live with the index, so what it
    taught outlives a controller rebuilt around it (``bench.e2e`` builds one per configuration).
    """

    def __init__(
        self,
        index: VectorIndex,
        stages: Callable[[], Iterator[StageResult]],
        stats: StageStatistics,
        key: PlanKey,
        single: bool,
        learn: bool,
    ) -> None:
        self._index = index  # whose search threads run an ``async for``, as they are then
        self._stages = stages  # batch-shaped stages, computed when called
        self._stats = stats
        self._key = key
        self._single = single  # a batch's results are 2-D and not learned from
        self._learn = learn
        self._running: AsyncGenerator[StageResult, None] | None = None

    def __iter__(self) -> Iterator[StageResult]:
        stages = self._stages()
        return (stage.for_query(0) for stage in stages) if self._single else stages

    def __aiter__(self) -> AsyncGenerator[StageResult, None]:
        if self._running is None:
            self._running = self._stream()
        return self._running

    async def aclose(self) -> None:
        """Stop the search after the stage in flight (what ``contextlib.aclosing`` calls)."""
        if self._running is not None:
            await self._running.aclose()

    async def _stream(self) -> AsyncGenerator[StageResult, None]:
        seen: list[StageResult] = []
        async with contextlib.aclosing(self._index.runner.stream(self._stages)) as stages:
            async for stage in stages:
                if not self._single:
                    yield stage
                    continue
                seen.append(stage.for_query(0))
                # Learned before the caller sees the end (it may stop reading there).
                if stage.done and self._learn:
                    self._stats.record(self._key, seen)
                yield seen[-1]

    def outlook(self, stage: int, elapsed_s: float) -> StageOutlook:
        """What searches of this plan taught about the rest of this one after ``stage`` (0: its
        start), ``elapsed_s`` into it (:meth:`StageStatistics.outlook`)."""
        return self._stats.outlook(self._key, stage, elapsed_s)
