"""A long history: a document replaced many times is still found first by its own text, in the
dense channel, the lexical channel and fused, one-shot and staged, with no compaction to help."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.retrieval.index.hybrid import lexical_ranking
from tests.helpers.live_corpus import text_corpus

REPLACEMENTS = 500


def first_found(corpus: LiveCorpus, text: str) -> tuple[int, int, int, int]:
    """The first passage each channel finds for ``text``: dense, lexical, fused, fused staged."""
    index = corpus.index
    query = index.embed_query(text)
    dense = index.ranked_rows(index.search(query, 5)[1])
    assert index.lexical is not None
    lexical = lexical_ranking(index.lexical, index.fusion, text, index.visibility).tolist()
    fused = index.ranked_rows(index.search(query, 5, query_text=text)[1])
    staged = [index.ranked_rows(stage.ids) for stage in index.search_staged(query, 5, query_text=text)]
    assert staged[-1] == fused  # the last stage is the one-shot search
    return dense[0], lexical[0], fused[0], staged[-1][0]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_a_document_put_500_times_is_found_first_by_its_own_text(tmp_path: Path, kind: str) -> None:
    """A nightly re-sync: the same text PUT again and again; every old version stays in the index
    (no compaction), hidden, as near to the query as the current one."""
    corpus = text_corpus(tmp_path, kind)
    passage = corpus.store.passage(7)
    assert first_found(corpus, passage.text) == (7, 7, 7, 7)
    for _ in range(REPLACEMENTS):
        corpus.put([passage])
    row = corpus.store.row_of(passage.id)
    assert corpus.index.hidden_rows == REPLACEMENTS and corpus.get(passage.id).version == REPLACEMENTS + 1
    assert first_found(corpus, passage.text) == (row, row, row, row)
