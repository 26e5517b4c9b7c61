"""A staged searcher as an index opens it: what it declared it can do, checked once, as typed views.

Every searcher declares its :class:`~specrag.retrieval.search.stages.Capabilities`; opening it checks
each declared one against the methods it needs (:class:`~specrag.retrieval.live_index.Growable`,
:class:`RanksText`, :class:`AnswersPartially`, ...) and refuses a searcher that claims what it
lacks, so the index asks its searcher's capabilities, never its class, and a missing method shows
at open rather than in the middle of a search. The dense searches are routed here by them: a
searcher that can skip hidden rows is given the search's visibility when some are hidden (a
database's always), and one whose parts may fail is given the record of which answered.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.shards.merge import ShardAnswers
from specrag.retrieval.live_index import Growable, Retrainable, Visibility
from specrag.retrieval.search.stages import StagedSearcher, StagePlan, StageResult

__all__ = ["AnswersPartially", "OpenedSearcher", "RanksText"]


@runtime_checkable
class RanksText(Protocol):
    """A searcher that ranks its rows by a query's words itself, in the same read of its rows as
    its vector search (a database's full-text search in the stages' snapshot), when it declares
    ``ranks_text``: the index then fuses that ranking instead of its own BM25's. Rankings are
    rows best first, ``depth`` per query, padded with ``-1``."""

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


@runtime_checkable
class AnswersPartially(Protocol):
    """A searcher over parts that may fail one by one (shards), which, given ``answers``, leaves a
    failed part out of the search and records which parts answered instead of failing it."""

    def search(
        self,
        queries: np.ndarray,
        k: int,
        visibility: Visibility | None = None,
        answers: ShardAnswers | None = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def stages(
        self,
        queries: np.ndarray,
        k: int,
        plan: StagePlan,
        visibility: Visibility | None = None,
        answers: ShardAnswers | None = None,
    ) -> Iterator[StageResult]: ...


def _refuse(searcher: StagedSearcher, capability: str, needs: str) -> InvalidInputError:
    return InvalidInputError(f"the {searcher.kind} searcher declares {capability} but lacks {needs}")


def _takes(parameter: str, searcher: Growable | AnswersPartially) -> bool:
    """Whether both of its searches take ``parameter`` (every searcher has a ``search`` and
    ``stages``, so only their parameters tell these capabilities apart)."""
    methods = (searcher.search, searcher.stages)
    return all(parameter in inspect.signature(method).parameters for method in methods)


@dataclass(frozen=True)
class OpenedSearcher:
    """``searcher`` with a typed view of each capability it declared (None: not declared)."""

    searcher: StagedSearcher
    live: Growable | None
    retrainable: Retrainable | None
    text: RanksText | None
    partial: AnswersPartially | None
    snapshot_rows: bool

    @classmethod
    def of(cls, searcher: StagedSearcher) -> OpenedSearcher:
        """Open ``searcher``: InvalidInputError names a capability it declares without its methods."""
        declared = searcher.capabilities
        live: Growable | None = None
        if declared.live_rows or declared.retrains or declared.snapshot_rows:
            if not declared.live_rows:
                raise _refuse(searcher, "retrains or snapshot_rows", "live_rows, which both need")
            if not isinstance(searcher, Growable) or not _takes("visibility", searcher):
                raise _refuse(searcher, "live_rows", "next_row, add, compacted, searches given a visibility")
            live = searcher
        retrainable: Retrainable | None = None
        if declared.retrains:
            if not isinstance(searcher, Retrainable):
                raise _refuse(searcher, "retrains", "retrained, centroid_distance")
            retrainable = searcher
        text: RanksText | None = None
        if declared.ranks_text:
            if not isinstance(searcher, RanksText):
                raise _refuse(searcher, "ranks_text", "search_text, stages_text")
            text = searcher
        partial: AnswersPartially | None = None
        if declared.partial_answers:
            if not isinstance(searcher, AnswersPartially) or not _takes("answers", searcher):
                raise _refuse(searcher, "partial_answers", "a search and stages that take answers")
            partial = searcher
        return cls(searcher, live, retrainable, text, partial, declared.snapshot_rows)

    def depth(self, k: int, visibility: Visibility, deeper: int) -> int:
        """How deep a dense-only search reads for a top-k: ``k``, or ``deeper`` while rows are
        hidden and the searcher cannot skip them itself."""
        return k if not visibility.hidden or self.live is not None else deeper

    def search(
        self, matrix: np.ndarray, depth: int, visibility: Visibility, answers: ShardAnswers | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The searcher's one-shot search, skipping hidden rows at the source when it can (a
        growable searcher): old versions then never crowd the current ones out of its top."""
        if answers is not None and self.partial is not None:
            return self.partial.search(matrix, depth, visibility if visibility.hidden else None, answers)
        if self.live is not None and self._given_visibility(visibility):
            return self.live.search(matrix, depth, visibility)
        return self.searcher.search(matrix, depth)

    def stages(
        self,
        matrix: np.ndarray,
        depth: int,
        plan: StagePlan,
        visibility: Visibility,
        answers: ShardAnswers | None,
    ) -> Iterator[StageResult]:
        """The searcher's stages, skipping hidden rows as :meth:`search` does."""
        if answers is not None and self.partial is not None:
            return self.partial.stages(
                matrix, depth, plan, visibility if visibility.hidden else None, answers
            )
        if self.live is not None and self._given_visibility(visibility):
            return self.live.stages(matrix, depth, plan, visibility)
        return self.searcher.stages(matrix, depth, plan)

    def _given_visibility(self, visibility: Visibility) -> bool:
        """Whether the searcher takes the search's visibility: while rows are hidden, and a
        database's always (its snapshot may hold a version committed after the visibility was
        read, which it shows as the version the visibility holds)."""
        return bool(visibility.hidden) or self.snapshot_rows
