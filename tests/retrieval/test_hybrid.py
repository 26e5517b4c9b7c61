"""Hybrid staged search: BM25 fused into every stage, the last stage equal to the one-shot search."""

from __future__ import annotations

import json
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.corpus import Passage, split_text
from specrag.retrieval.index_store import MANIFEST_FILE, IndexConfig, build_index, load_index, save_index
from specrag.retrieval.lexical.fusion import fuse
from specrag.retrieval.lexical.identifiers import named_identifiers
from specrag.retrieval.search.stages import StagePlan
from specrag.retrieval.vector_index import VectorIndex

UNIQUE_WORD = "zyxwvutsr"
QUERIES = [
    "how does the with statement call __exit__",
    "integer division and modulo of negative numbers",
    "what does assert do when optimisation is on",
    "comparing sequences lexicographically",
    UNIQUE_WORD,
]


@pytest.fixture(scope="module")
def corpus() -> list[Passage]:
    """Real text: Python's language-reference topics, as passages, plus one with a unique word."""
    passages = [
        Passage(f"{name}#{n}", name, chunk)
        for name in sorted(topics)[:60]
        for n, chunk in enumerate(split_text(topics[name]))
    ]
    return [*passages, Passage("unique#0", "misc", f"The {UNIQUE_WORD} setting is rarely needed.")]


@pytest.fixture(scope="module", params=["ivf", "hnsw"])
def index(request: pytest.FixtureRequest, corpus: list[Passage]) -> VectorIndex:
    return build_index(corpus, IndexConfig(kind=request.param, nlist=8, ef_search=128))


def stages_of(index: VectorIndex, text: str, k: int, stages: int = 4, hybrid: bool = True) -> list:
    vector = index.embed_query(text)
    return list(
        index.search_staged(vector, k, StagePlan(stages, "equal"), query_text=text if hybrid else None)
    )


@pytest.mark.parametrize("query", QUERIES)
def test_every_stage_fuses_bm25_with_the_running_dense_top_k(index: VectorIndex, query: str) -> None:
    k, plan = 8, StagePlan(4, "equal")
    vector = index.embed_query(query)
    assert index.lexical is not None
    lexical, _ = index.lexical.search(query, index.fusion.depth, index.fusion.identifier_weight)
    names_identifier = bool(named_identifiers(query))
    dense = list(index.searcher.stages(vector[None, :], index.fusion.dense_depth(k), plan))
    hybrid = list(index.search_staged(vector, k, plan, query_text=query))
    assert len(hybrid) == len(dense) and [s.done for s in hybrid] == [s.done for s in dense]
    for fused, running in zip(hybrid, dense, strict=True):
        expected_ids, expected_scores = fuse(
            lexical, index.passage_index_of(running.ids[0]), k, index.fusion, names_identifier
        )
        np.testing.assert_array_equal(fused.ids, expected_ids)
        np.testing.assert_array_equal(fused.distances, expected_scores)
    one_shot_scores, one_shot_ids = index.search(vector, k, query_text=query)
    np.testing.assert_array_equal(hybrid[-1].ids, one_shot_ids)
    np.testing.assert_array_equal(hybrid[-1].distances, one_shot_scores)


def test_the_lexical_match_is_there_from_the_first_stage(index: VectorIndex, corpus: list[Passage]) -> None:
    # BM25 ranks the only passage holding the word first; fused, it is at worst second (after a
    # dense first place of equal score) in the very first stage.
    first = stages_of(index, UNIQUE_WORD, 5)[0]
    assert len(corpus) - 1 in first.ids[:2].tolist()


def test_results_name_distinct_passages_even_when_padded(corpus: list[Passage]) -> None:
    padded = build_index(corpus, IndexConfig(nlist=16, pad_to=6000))
    for query in QUERIES:
        for stage in stages_of(padded, query, 10):
            rows = stage.ids[stage.ids >= 0]
            assert len(set(rows.tolist())) == len(rows) == 10
            assert rows.max() < len(corpus)
        last = stages_of(padded, query, 10)[-1]
        np.testing.assert_array_equal(
            last.ids, padded.search(padded.embed_query(query), 10, query_text=query)[1]
        )


def test_without_text_or_lexical_channel_the_search_is_dense(
    index: VectorIndex, corpus: list[Passage]
) -> None:
    query = QUERIES[0]
    vector = index.embed_query(query)
    plain = list(index.searcher.stages(vector[None, :], 6, StagePlan(3, "equal")))
    for mine, theirs in zip(stages_of(index, query, 6, 3, hybrid=False), plain, strict=True):
        np.testing.assert_array_equal(mine.ids, theirs.ids[0])
    dense_index = build_index(corpus, IndexConfig(nlist=8, lexical=False))
    assert not dense_index.hybrid
    with_text = stages_of(dense_index, query, 6, 3)
    without = stages_of(dense_index, query, 6, 3, hybrid=False)
    for a, b in zip(with_text, without, strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)


async def test_async_hybrid_stages_match_the_sync_ones(index: VectorIndex) -> None:
    query = QUERIES[1]
    vector = index.embed_query(query)
    received = [s async for s in index.search_staged(vector, 7, StagePlan(3, "equal"), query_text=query)]
    expected = stages_of(index, query, 7, 3)
    assert [s.done for s in received] == [False] * (len(received) - 1) + [True]
    for got, want in zip(received, expected, strict=True):
        np.testing.assert_array_equal(got.ids, want.ids)
    batch = [
        s
        async for s in index.search_staged(
            np.stack([vector, vector]), 7, index.stage_plan(3), query_text=[query, query], batch=True
        )
    ]
    np.testing.assert_array_equal(batch[-1].ids[1], expected[-1].ids)


async def test_query_texts_must_match_the_queries(index: VectorIndex) -> None:
    vector = index.embed_query("x")
    with pytest.raises(InvalidInputError, match="query texts"):
        async for _ in index.search_staged(
            np.stack([vector, vector]), 3, query_text=["only one"], batch=True
        ):
            pass
    with pytest.raises(InvalidInputError, match="strings"):
        list(index.search_staged(vector[None, :], 3, query_text=[b"bytes"], batch=True))  # type: ignore[list-item]


def test_save_and_load_keep_the_hybrid_results(index: VectorIndex, tmp_path: Path) -> None:
    save_index(index, tmp_path / "hybrid")
    manifest = json.loads((tmp_path / "hybrid" / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert all(name in manifest["files"] for name in manifest["lexical"]["files"])
    loaded = load_index(tmp_path / "hybrid")
    assert loaded.hybrid and loaded.fusion == index.fusion
    for query in QUERIES:
        np.testing.assert_array_equal(stages_of(loaded, query, 8)[-1].ids, stages_of(index, query, 8)[-1].ids)


def test_the_configuration_tells_an_index_of_another_kind(
    index: VectorIndex, corpus: list[Passage], tmp_path: Path
) -> None:
    assert IndexConfig().mismatch(index) is None
    assert "dense only" in str(
        IndexConfig().mismatch(build_index(corpus, IndexConfig(nlist=8, lexical=False)))
    )
    tfidf = build_index(corpus, IndexConfig(embedder="tfidf-svd", embedding_dim=16, nlist=8))
    assert tfidf.embedder is not None
    assert "tfidf-svd" in str(IndexConfig().embedder_mismatch(tfidf.embedder.save(tmp_path)))
