"""bench.retrieval.search: the second HNSW implementation (hnswlib on the same vectors, queries and exact
top-k), and the stage schedules' figures and choice."""

from __future__ import annotations

from typing import Any

import faiss

from bench.retrieval.search import (
    SCHEDULE_NAMES,
    Setting,
    best_schedule,
    build_hnswlib,
    measure,
    measure_hnswlib,
)
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
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


def test_schedules_are_measured_and_the_best_is_the_earliest_within_the_cost_limit() -> None:
    vectors = GaussianMixture(32, seed=0).sample(4000)
    queries = queries_near(vectors, 12, seed=1)
    searcher = StagedIVF.build(vectors, nlist=64, nprobe=32)
    measured = measure(searcher, queries, 5)
    assert set(measured["per_schedule"]) == set(SCHEDULE_NAMES)
    assert measured["final_equals_oneshot"]
    for row in measured["per_schedule"].values():
        assert 0.0 < row["final_at_time_fraction"] <= 1.0

    def entry(kind: str, **final_at: float) -> dict[str, Any]:
        overheads = {"equal": 1.02, "geometric": 1.05, "geometric/5": 1.12, "geometric/6": 1.0, "budget": 1.5}
        return {
            "kind": kind,
            "per_schedule": {
                name: {"staging_overhead": overheads[name], "final_at_time_fraction": final_at[name]}
                for name in SCHEDULE_NAMES
            },
        }

    # The budget and 5-stage schedules are earliest but too costly; the rest compete per kind,
    # over the mean of that kind's settings only.
    ivf = entry("ivf", equal=0.5, geometric=0.3, budget=0.1, **{"geometric/5": 0.05, "geometric/6": 0.2})
    hnsw = entry("hnsw", equal=0.2, geometric=0.3, budget=0.1, **{"geometric/5": 0.05, "geometric/6": 0.6})
    assert best_schedule([ivf, hnsw]) == {"ivf": "geometric/6", "hnsw": "equal"}
    slow_hnsw = entry(
        "hnsw", equal=0.3, geometric=0.1, budget=0.1, **{"geometric/5": 0.1, "geometric/6": 0.1}
    )
    assert best_schedule([ivf, hnsw, slow_hnsw]) == {"ivf": "geometric/6", "hnsw": "geometric"}
