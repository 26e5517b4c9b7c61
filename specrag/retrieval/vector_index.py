"""The searchable index the controller holds: a staged searcher plus the row → passage mapping.

Its parts live in :mod:`specrag.retrieval.index`: the searcher as its declared capabilities open
it (:mod:`~specrag.retrieval.index.searcher`: the index asks what its searcher can do, never which
class it is), the row → passage mapping and the live changes that add and hide rows
(:mod:`~specrag.retrieval.index.rows`), and the lexical channel of a hybrid search
(:mod:`~specrag.retrieval.index.hybrid`); a staged search it starts is a
:class:`~specrag.retrieval.search.staged_search.StagedSearch`.

Row i of the index is passage i of the corpus it was built from, or, in a padded index, a
synthetic row that :meth:`VectorIndex.passage_index_of` maps to the passage it was drawn around.
Given the query's text, an index with a lexical channel searches hybrid: every stage's running
top-k is the fusion of the dense one with the query's lexical ranking, so it names passages and
scores them by fusion. A live corpus changes the index while searches run
(:meth:`VectorIndex.apply_changes`), each search seeing the corpus in one state.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.shards.merge import ShardAnswers
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index import hybrid
from specrag.retrieval.index.rows import PassageRows, PreparedChanges, visible_top
from specrag.retrieval.index.searcher import OpenedSearcher
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.lexical.fusion import FusionConfig
from specrag.retrieval.live_index import Growable, Retrainable, Visibility
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stage_stats import PlanKey, StageStatistics
from specrag.retrieval.search.staged_search import StagedSearch
from specrag.retrieval.search.stages import (
    StagedSearcher,
    StagePlan,
    StageResult,
    prepare_queries,
    stage_plan,
)
from specrag.retrieval.text import normalize_text

__all__ = ["PreparedChanges", "StagedSearch", "VectorIndex"]


class VectorIndex:
    """Staged search by vector, one query or a batch, synchronously or on the event loop.

    ``k`` larger than the index gives ``-1`` ids (and faiss's neutral distance) in the slots
    that no row fills; an empty index or a query of the wrong dimension raises InvalidInputError.
    A searcher that declares a capability it lacks is refused here, when it is opened
    (:class:`~specrag.retrieval.index.searcher.OpenedSearcher`), and again whenever one is swapped in.
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
        self._rows = PassageRows(searcher.ntotal, passage_ids, synthetic_sources, lexical)
        self._opened = OpenedSearcher.of(searcher)
        self._default_stages = default_stages  # for a searcher of a kind with no default (a test's)
        self.lexical = lexical
        self.fusion = fusion or FusionConfig()
        self.embedder = embedder
        self._runner = runner
        # How each stage's top-k turned out, learned from every single-query staged search.
        self._stage_stats = StageStatistics()

    @property
    def searcher(self) -> StagedSearcher:
        """The staged searcher; one assigned here is opened (its capabilities checked) first."""
        return self._opened.searcher

    @searcher.setter
    def searcher(self, searcher: StagedSearcher) -> None:
        self._opened = OpenedSearcher.of(searcher)

    @contextlib.contextmanager
    def searching_through(self, searcher: StagedSearcher) -> Iterator[None]:
        """Within the block, search through ``searcher`` (opened, its capabilities checked, first),
        which must hold the same rows; the searcher held before comes back on exit, error or not
        (a sharded index's Ray actors stand in for its shards' manifests while the service runs)."""
        previous = self._opened
        held = previous.searcher.ntotal
        if searcher.ntotal != held:
            raise InvalidInputError(
                f"the {searcher.kind} searcher holds {searcher.ntotal} rows, the index {held}"
            )
        self._opened = OpenedSearcher.of(searcher)
        try:
            yield
        finally:
            self._opened = previous

    @property
    def retrainable(self) -> Retrainable | None:
        """The searcher as one whose centroids can be trained anew (None: it declared no
        ``retrains``, as an HNSW graph, a sharded index or a database)."""
        return self._opened.retrainable

    @property
    def passage_ids(self) -> list[str]:
        """Each row's passage id, the added documents' rows included (synthetic rows excluded)."""
        return self._rows.passage_ids

    @property
    def synthetic_sources(self) -> np.ndarray:
        """The passage each synthetic row (after the passages' rows) was drawn around."""
        return self._rows.synthetic_sources

    @property
    def visibility(self) -> Visibility:
        """Which rows searches starting now see, and the added documents' BM25 (one snapshot)."""
        return self._rows.visibility

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
        return self.lexical is not None or self._opened.text is not None

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
        return self._rows.passages(row_ids, visibility)

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
        searcher = self._growable() if len(ids) else None
        return self._rows.prepare(ids, vectors, texts, retired, searcher, self.dim)

    def apply_prepared(self, change: PreparedChanges) -> list[int]:
        """Apply a prepared change (:meth:`PassageRows.apply
        <specrag.retrieval.index.rows.PassageRows.apply>`): running it again after a failure
        part-way completes it, running a completed one again changes nothing; returns the new rows."""
        return self._rows.apply(change, self._opened.live)

    def check_growable(self) -> None:
        """Raise InvalidInputError unless this index can take new documents while it serves."""
        self._growable()

    def _growable(self) -> Growable:
        """The searcher as one that takes rows, or InvalidInputError when this index cannot."""
        live = self._opened.live
        if live is None:
            raise InvalidInputError(
                f"a {self.searcher.kind} index cannot take documents while it serves: "
                "build an IVF or HNSW index"
            )
        if len(self.synthetic_sources):
            raise InvalidInputError("a padded index (synthetic rows) cannot take documents")
        return live

    @property
    def visible_rows(self) -> np.ndarray:
        """Which index rows searches may return now (one flag a row)."""
        return self.visibility.visible

    @property
    def removable_rows(self) -> int:
        """Hidden rows the searcher still holds (and scans): what :meth:`compact` drops."""
        return self.searcher.ntotal - int(np.count_nonzero(self.visibility.visible))

    def compact(self, retrain: bool = False) -> int:
        """Swap in a searcher without the hidden rows (searches in flight finish on the old one),
        with centroids trained anew on the rows kept when ``retrain`` (an IVF index's: an HNSW
        graph has none); returns the rows dropped. The caller keeps changes out while it runs
        (one writer)."""
        opened = self._opened
        if opened.live is None:
            raise InvalidInputError(f"a {self.searcher.kind} index cannot be compacted while it serves")
        visible = self.visibility.visible
        if opened.live.next_row != len(visible):
            raise InvalidInputError("a change is half applied: apply it again before compacting")
        dropped = self.removable_rows
        replacement: Growable
        if not retrain:
            replacement = opened.live.compacted(visible)
        elif opened.retrainable is not None:
            replacement = opened.retrainable.retrained(visible)
        else:
            raise InvalidInputError(f"a {self.searcher.kind} index has no centroids to re-train")
        self.searcher = replacement  # type: ignore[assignment]
        return dropped

    @property
    def hidden_rows(self) -> int:
        """Rows of replaced or deleted documents that every search filters out (compaction's cue)."""
        return self.visibility.hidden

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
        opened, visibility, fusion = self._opened, self.visibility, self.fusion
        texts = self._texts(query_text, batch)
        if texts is not None and opened.text is not None:
            ids, distances = hybrid.text_search(
                opened.text, fusion, self.passage_index_of, matrix, k, texts, visibility
            )
            return (distances, ids) if batch else (distances[0], ids[0])
        lexical = hybrid.lexical_rankings(self.lexical, fusion, texts, len(matrix), visibility)
        if lexical is None:
            depth = opened.depth(k, visibility, fusion.dense_depth(k))
            distances, ids = visible_top(
                *opened.search(matrix, depth, visibility, shard_answers), k, visibility
            )
        else:
            _, rows = opened.search(matrix, fusion.dense_depth(k), visibility, shard_answers)
            ids, distances = hybrid.fused(lexical, self.passage_index_of(rows, visibility), k, fusion)
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
        ``shard_answers`` (a searcher whose parts may fail) accepts a top-k missing the shards that
        fail, and records which answered (:class:`~specrag.retrieval.backends.shards.merge.ShardAnswers`).
        """
        matrix = prepare_queries(self._shaped(queries, batch), self.dim, self.searcher.ntotal, k)
        resolved = plan or self.stage_plan()

        def stages() -> Iterator[StageResult]:
            return self._stages(matrix, k, resolved, self._texts(query_text, batch), shard_answers)

        key = self._plan_key(k, resolved)
        return StagedSearch(
            lambda: self.runner, stages, self._stage_stats, key, single=not batch, learn=learn
        )

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
        opened, visibility, fusion = self._opened, self.visibility, self.fusion
        if texts is not None and opened.text is not None:
            yield from hybrid.text_stages(
                opened.text, fusion, self.passage_index_of, matrix, k, plan, texts, visibility
            )
            return
        lexical = hybrid.lexical_rankings(self.lexical, fusion, texts, len(matrix), visibility)
        if lexical is None:
            depth = opened.depth(k, visibility, fusion.dense_depth(k))
            for stage in opened.stages(matrix, depth, plan, visibility, shard_answers):
                distances, ids = visible_top(stage.distances, stage.ids, k, visibility)
                yield StageResult(stage.stage, ids, distances, stage.done, stage.elapsed_s)
            return
        lexical_s = time.perf_counter() - started
        for stage in opened.stages(matrix, fusion.dense_depth(k), plan, visibility, shard_answers):
            ids, scores = hybrid.fused(lexical, self.passage_index_of(stage.ids, visibility), k, fusion)
            elapsed_s = stage.elapsed_s + (lexical_s if stage.stage == 1 else 0.0)
            yield StageResult(stage.stage, ids, scores, stage.done, elapsed_s)

    def _plan_key(self, k: int, plan: StagePlan) -> PlanKey:
        """What the stage statistics keep a search's figures under: the searcher's settings, k and
        the stage plan."""
        settings = tuple(sorted((name, str(value)) for name, value in self.searcher.settings.items()))
        return PlanKey(settings, k, plan.num_stages, plan.schedule)
