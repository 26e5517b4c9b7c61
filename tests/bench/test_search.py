"""bench.search's second HNSW implementation: hnswlib on the same vectors, queries and exact top-k."""

from __future__ import annotations

import faiss

from bench.search import Setting, build_hnswlib, measure_hnswlib
from specrag.retrieval.synthetic import GaussianMixture, queries_near


def test_hnswlib_with_a_beam_as_wide_as_the_data_finds_the_exact_top_k() -> None:
    vectors = GaussianMixture(32, num_clusters=8, seed=0).sample(300)
    queries = queries_near(vectors, 20, seed=1)
    exact = faiss.IndexFlatIP(32)
    exact.add(vectors)
    exact_ids = exact.search(queries, 10)[1]
    # efSearch = every vector: the beam search visits the whole (connected) graph.
    index = build_hnswlib(Setting("hnsw", 300, {"m": 8, "ef_search": 300}), vectors, threads=1, seed=0)
    result = measure_hnswlib(index, queries, exact_ids, k=10)
    assert result["recall_at_k"] == 1.0
    assert result["oneshot_ms_median"] > 0
