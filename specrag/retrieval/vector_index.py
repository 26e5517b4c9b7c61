"""The searchable index the controller holds: a staged searcher plus the row → passage mapping.

Row i of the index is passage i of the corpus it was built from. A padded index (see
:mod:`specrag.retrieval.synthetic`) has more rows than passages; each extra row maps to the real
passage it was drawn around, and :meth:`VectorIndex.passage_index_of` applies that mapping so
the caller never sees a row id that is not a passage (several rows may name one passage).

An index built with a lexical channel (:mod:`specrag.retrieval.lexical`) searches hybrid when
it is given the query's text: BM25 runs first, in the search thread, before the first dense stage
(a millisecond against the dense search's tens), and every stage's running top-k is the
reciprocal-rank fusion (:mod:`specrag.retrieval.fusion`) of that fixed lexical ranking with the
dense running top-k. The running top-k that speculation prefills is therefore already the hybrid
one, and the last stage equals :meth:`VectorIndex.search_hybrid`. Fused stages name passages:
their ids are passage positions (real rows) and their ``distances`` are fused scores, higher first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Iterator, Sequence

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders import Embedder
from specrag.retrieval.fusion import FusionConfig, fuse
from specrag.retrieval.identifiers import named_identifiers
from specrag.retrieval.lexical import LexicalIndex
from specrag.retrieval.search_runner import SearchRunner
from specrag.retrieval.stage_stats import PlanKey, StageStatistics
from specrag.retrieval.stages import StagedSearcher, StagePlan, StageResult, prepare_queries, stage_plan
from specrag.retrieval.text import normalize_text


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
        self.stage_stats = StageStatistics()
        # Row -> passage, with a trailing -1 so that padding ids (-1) map to -1 by plain indexing.
        self._row_to_passage = np.concatenate([np.arange(len(passage_ids)), sources, [-1]])

    @property
    def dim(self) -> int:
        return self.searcher.dim

    def stage_plan(
        self, num_stages: int | None = None, schedule: str | None = None, stage_budget_s: float | None = None
    ) -> StagePlan:
        """How a staged search of this index is cut: the given settings, the index kind's defaults
        for the rest (:func:`~specrag.retrieval.stages.stage_plan`); ``stage_budget_s`` instead
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
        return self.lexical is not None

    @property
    def runner(self) -> SearchRunner:
        """The thread pool async searches use (one unpinned worker unless one was given)."""
        if self._runner is None:
            self._runner = SearchRunner()
        return self._runner

    def use_runner(self, runner: SearchRunner) -> None:
        """Run async searches on ``runner`` (e.g. pinned to cores apart from the LLM engine)."""
        self._runner = runner

    def passage_index_of(self, row_ids: np.ndarray) -> np.ndarray:
        """Corpus positions of index rows (same shape); ``-1`` stays ``-1``."""
        rows = np.asarray(row_ids, dtype=np.int64)
        if rows.size and (rows.min() < -1 or rows.max() >= self.searcher.ntotal):
            raise InvalidInputError(f"row ids outside [-1, {self.searcher.ntotal})")
        return self._row_to_passage[rows]

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

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One-shot search (no stages): (distances, ids), one row per query."""
        return self.searcher.search(queries, k)

    def _single(self, query: np.ndarray) -> np.ndarray:
        if np.ndim(query) != 1:
            raise InvalidInputError(
                f"expected one query vector, got shape {np.shape(query)}; use the batch variant"
            )
        return np.asarray(query)

    def search_hybrid(self, query: np.ndarray, query_text: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One-shot hybrid search of one query: (passages, fused scores), best first, 1-D.

        What the last stage of a staged search with ``query_text`` equals. Without a lexical
        channel it is the dense search's passages, in rank order, repeats dropped.
        """
        matrix = prepare_queries(self._single(query), self.dim, self.searcher.ntotal, k)
        lexical = self._lexical_rankings([query_text], 1) or [(np.zeros(0, dtype=np.int64), False)]
        _, rows = self.searcher.search(matrix, self.fusion.dense_depth(k))
        ranking, names_identifier = lexical[0]
        return fuse(ranking, self.passage_index_of(rows[0]), k, self.fusion, names_identifier)

    def _lexical_rankings(
        self, texts: Sequence[str] | None, num_queries: int
    ) -> list[tuple[np.ndarray, bool]] | None:
        """Each query's lexical ranking (passages) and whether it names an identifier, or None
        when the search is dense only."""
        if texts is None or self.lexical is None:
            return None
        if isinstance(texts, str) or len(texts) != num_queries:
            raise InvalidInputError(f"expected {num_queries} query texts, one per query vector")
        if not all(isinstance(text, str) for text in texts):
            raise InvalidInputError("query texts must be strings")
        weight = self.fusion.identifier_weight
        return [
            (self.lexical.search(text, self.fusion.depth, weight)[0], bool(named_identifiers(text)))
            for text in texts
        ]

    def _stages(
        self, matrix: np.ndarray, k: int, plan: StagePlan, texts: Sequence[str] | None
    ) -> Iterator[StageResult]:
        """Dense stages, or, given texts and a lexical channel, each one fused with BM25's ranking.

        The lexical search runs before the first dense stage; its time is charged to that stage.
        """
        started = time.perf_counter()
        lexical = self._lexical_rankings(texts, len(matrix))
        if lexical is None:
            yield from self.searcher.stages(matrix, k, plan)
            return
        lexical_s = time.perf_counter() - started
        for stage in self.searcher.stages(matrix, self.fusion.dense_depth(k), plan):
            passages = self.passage_index_of(stage.ids)
            fused = [
                fuse(ranking, row, k, self.fusion, names_identifier)
                for (ranking, names_identifier), row in zip(lexical, passages, strict=True)
            ]
            yield StageResult(
                stage.stage,
                np.stack([ids for ids, _ in fused]),
                np.stack([scores for _, scores in fused]),
                stage.done,
                stage.elapsed_s + (lexical_s if stage.stage == 1 else 0.0),
            )

    def iter_stages_batch(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan | None = None,
        query_texts: Sequence[str] | None = None,
    ) -> Iterator[StageResult]:
        """Stages of a batch search in the calling thread; results hold one row per query.

        With ``query_texts`` (one per query) and a lexical channel, every stage is hybrid.
        """
        matrix = prepare_queries(queries, self.dim, self.searcher.ntotal, k)
        return self._stages(matrix, k, plan or self.stage_plan(), query_texts)

    def iter_stages(
        self,
        query: np.ndarray,
        k: int,
        plan: StagePlan | None = None,
        query_text: str | None = None,
    ) -> Iterator[StageResult]:
        """Stages of one query in the calling thread (for scripts); results are 1-D."""
        texts = None if query_text is None else [query_text]
        return (stage.for_query(0) for stage in self.iter_stages_batch(self._single(query), k, plan, texts))

    async def search_staged_batch(
        self,
        queries: np.ndarray,
        k: int,
        *,
        num_stages: int | None = None,
        stage_budget_s: float | None = None,
        schedule: str | None = None,
        query_texts: Sequence[str] | None = None,
    ) -> AsyncGenerator[StageResult, None]:
        """``async for`` over the stages of a batch search run on the search threads.

        With ``query_texts`` (one per query) and a lexical channel, every stage is hybrid (see
        the module's docstring); without either, the stages are the dense search's. Leaving the
        loop (use ``contextlib.aclosing`` to make it immediate) or cancelling the task stops the
        search after the stage in flight. Settings left None are the index kind's
        (:meth:`stage_plan`).
        """
        plan = self.stage_plan(num_stages, schedule, stage_budget_s)
        matrix = prepare_queries(queries, self.dim, self.searcher.ntotal, k)
        async with contextlib.aclosing(
            self.runner.stream(lambda: self._stages(matrix, k, plan, query_texts))
        ) as stages:
            async for stage in stages:
                yield stage

    async def search_staged(
        self,
        query: np.ndarray,
        k: int,
        *,
        num_stages: int | None = None,
        stage_budget_s: float | None = None,
        schedule: str | None = None,
        query_text: str | None = None,
    ) -> AsyncGenerator[StageResult, None]:
        """``async for`` over the 1-D stages of one query (see :meth:`search_staged_batch`).

        Pass the question as ``query_text`` to search hybrid when the index has a lexical channel.
        """
        batch = self.search_staged_batch(
            self._single(query)[None, :],
            k,
            num_stages=num_stages,
            stage_budget_s=stage_budget_s,
            schedule=schedule,
            query_texts=None if query_text is None else [query_text],
        )
        seen: list[StageResult] = []
        async with contextlib.aclosing(batch) as stages:
            async for stage in stages:
                seen.append(stage.for_query(0))
                if stage.done:  # learned before the caller sees the end (it may stop reading there)
                    self.stage_stats.record(self.plan_key(k, num_stages, schedule), seen)
                yield seen[-1]

    def plan_key(self, k: int, num_stages: int | None = None, schedule: str | None = None) -> PlanKey:
        """What :attr:`stage_stats` keeps a search's figures under: settings, k and the stage plan
        (the index kind's defaults for what is not given, as :meth:`stage_plan` resolves them)."""
        settings = tuple(sorted((name, str(value)) for name, value in self.searcher.settings.items()))
        plan = self.stage_plan(num_stages, schedule)
        return PlanKey(settings, k, plan.num_stages, plan.schedule)
