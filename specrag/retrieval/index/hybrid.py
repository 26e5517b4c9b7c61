"""The lexical channel of a hybrid search: each query's ranking by its words, fused with the dense one.

An index built with a lexical channel (:mod:`specrag.retrieval.lexical.bm25`) searches hybrid when
it is given the query's text: BM25 runs first, in the search thread, before the first dense stage
(a small fraction of the dense search's time, docs/retrieval.md), and every stage's running top-k
is the reciprocal-rank fusion (:mod:`specrag.retrieval.lexical.fusion`) of that fixed lexical
ranking with the dense running top-k. The running top-k that speculation prefills is therefore
already the hybrid one, and the last stage equals the one-shot search given the text. A searcher
that ranks query texts itself (:class:`~specrag.retrieval.index.searcher.RanksText`: a database's
full-text search, in the snapshot its stages read) gives the lexical ranking in place of BM25's,
with its first stage; it is fused the same way. Fused stages name passages: their ids are passage
positions (real rows) and their ``distances`` are fused scores, higher first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.index.searcher import RanksText
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.lexical.fusion import FusionConfig, distinct_in_order, fuse
from specrag.retrieval.lexical.identifiers import named_identifiers
from specrag.retrieval.live_index import Visibility, merge_rankings
from specrag.retrieval.search.stages import StagePlan, StageResult

__all__ = [
    "Ranking",
    "checked_texts",
    "fused",
    "lexical_ranking",
    "lexical_rankings",
    "text_search",
    "text_stages",
]

Ranking = tuple[np.ndarray, bool]
"""A query's lexical ranking of passages, best first, and whether the query names an identifier."""

PassagesOf = Callable[[np.ndarray, Visibility], np.ndarray]
"""The passages index rows stand for, as a visibility has them (the index's row → passage map)."""


def checked_texts(texts: Sequence[str], num_queries: int) -> Sequence[str]:
    """``texts``, refused unless they are strings, one per query."""
    if isinstance(texts, str) or len(texts) != num_queries:
        raise InvalidInputError(f"expected {num_queries} query texts, one per query vector")
    if not all(isinstance(text, str) for text in texts):
        raise InvalidInputError("query texts must be strings")
    return texts


def lexical_ranking(
    lexical: LexicalIndex, fusion: FusionConfig, text: str, visibility: Visibility
) -> np.ndarray:
    """A query's BM25 ranking of visible passages, the base's and the added documents' merged.

    Both skip hidden rows before they cut their ranking (the base by the visibility's flags,
    the added documents hold only their current versions), so each ranks ``depth`` visible ones.
    """
    added_lexical = visibility.lexical
    assert added_lexical is not None, "an index with a lexical channel keeps its added documents' BM25"
    depth, weight = fusion.depth, fusion.identifier_weight
    if not visibility.hidden and not len(added_lexical):
        return lexical.search(text, depth, weight)[0]
    allowed = visibility.visible if visibility.hidden else None
    base = lexical.search(text, depth, weight, allowed)
    added = added_lexical.search(lexical.query_terms(text, weight), depth)
    rows, _ = merge_rankings(base, added, depth)
    return rows[visibility.alive(rows)]


def lexical_rankings(
    lexical: LexicalIndex | None,
    fusion: FusionConfig,
    texts: Sequence[str] | None,
    num_queries: int,
    visibility: Visibility,
) -> list[Ranking] | None:
    """Each query's BM25 ranking, or None when the search is dense only (no texts, no channel)."""
    if texts is None or lexical is None:
        return None
    checked = checked_texts(texts, num_queries)
    return [
        (lexical_ranking(lexical, fusion, text, visibility), bool(named_identifiers(text)))
        for text in checked
    ]


def fused(
    lexical: Sequence[Ranking], passages: np.ndarray, k: int, fusion: FusionConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top-k passages and fused scores: its lexical ranking fused with its dense
    ``passages`` (one row per query)."""
    results = [
        fuse(ranking, row, k, fusion, names_identifier)
        for (ranking, names_identifier), row in zip(lexical, passages, strict=True)
    ]
    return np.stack([ids for ids, _ in results]), np.stack([scores for _, scores in results])


def _text_rankings(
    ranked: np.ndarray, texts: Sequence[str], visibility: Visibility, passages_of: PassagesOf
) -> list[Ranking]:
    """The searcher's rankings of rows by text as the lexical rankings of passages."""
    return [
        (distinct_in_order(row), bool(named_identifiers(text)))
        for row, text in zip(passages_of(ranked, visibility), texts, strict=True)
    ]


def text_search(
    searcher: RanksText,
    fusion: FusionConfig,
    passages_of: PassagesOf,
    matrix: np.ndarray,
    k: int,
    texts: Sequence[str],
    visibility: Visibility,
) -> tuple[np.ndarray, np.ndarray]:
    """The dense search fused with the searcher's own ranking by text: (passages, scores)."""
    checked = checked_texts(texts, len(matrix))
    _, rows, ranked = searcher.search_text(matrix, fusion.dense_depth(k), checked, fusion.depth, visibility)
    lexical = _text_rankings(ranked, checked, visibility, passages_of)
    return fused(lexical, passages_of(rows, visibility), k, fusion)


def text_stages(
    searcher: RanksText,
    fusion: FusionConfig,
    passages_of: PassagesOf,
    matrix: np.ndarray,
    k: int,
    plan: StagePlan,
    texts: Sequence[str],
    visibility: Visibility,
) -> Iterator[StageResult]:
    """Dense stages fused with the searcher's own ranking by text, which comes with the
    first stage to arrive (in the same snapshot as every stage)."""
    checked = checked_texts(texts, len(matrix))
    staged = searcher.stages_text(matrix, fusion.dense_depth(k), checked, fusion.depth, plan, visibility)
    lexical: list[Ranking] | None = None
    for stage, ranked in staged:
        if lexical is None:
            if ranked is None:
                raise InvalidInputError("a stage came without the ranking by text before it")
            lexical = _text_rankings(ranked, checked, visibility, passages_of)
        ids, scores = fused(lexical, passages_of(stage.ids, visibility), k, fusion)
        yield StageResult(stage.stage, ids, scores, stage.done, stage.elapsed_s)
