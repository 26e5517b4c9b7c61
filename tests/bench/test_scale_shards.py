"""bench.scale.shards: the projection's arithmetic, and the merge timed stage by stage."""

from __future__ import annotations

import numpy as np

from bench.scale.shards import PREFILL_MS_8B_GPU, project, timed_stages
from specrag.retrieval.backends.shards.build import build_ivf_shards
from specrag.retrieval.search.stages import StagePlan
from specrag.retrieval.synthetic import GaussianMixture, queries_near

COSTS = {
    "code_ns": 50.0,
    "centroid_ns": 20.0,
    "stage_round_trip_ms": 0.5,
    "merge_ms_fixed": 0.05,
    "merge_ms_per_shard": 0.01,
    "tail_p99_over_p50": 2.0,
    "stages": 6.0,
}


def test_the_projection_scales_the_scan_down_and_the_merge_up_with_nodes() -> None:
    projected = project(COSTS, 128)["projected"]
    rows = projected["1e+08"]["nodes"]
    # The scan (and its tail) is split among the nodes; the merge grows with them.
    gap = {nodes: row["search_ms_p99"] - row["search_ms_p50"] for nodes, row in rows.items()}
    assert gap["8"] > gap["16"] > gap["32"] > gap["64"] > 0
    assert rows["8"]["merge_share"] < rows["64"]["merge_share"]
    for row in rows.values():
        assert row["r"] == round(row["search_ms_p50"] / PREFILL_MS_8B_GPU, 3)
    # 10⁸ rows of 128 + 8 bytes over 8 nodes
    assert rows["8"]["sq8_gib_per_node"] == round(1e8 * 136 / 8 / 2**30, 1)
    assert projected["1e+09"]["nodes"]["8"]["search_ms_p50"] > rows["8"]["search_ms_p50"]


def test_a_timed_search_reports_one_merge_a_stage() -> None:
    vectors = GaussianMixture(16, num_clusters=10, seed=1).sample(2000)
    shards = build_ivf_shards(vectors, 2, nlist=16, nprobe=8)
    query = queries_near(vectors, 1, seed=2)[0]
    plan = StagePlan(4, "equal")
    ms, _, ids, merges = timed_stages(lambda q: shards.cursor(q, 10), shards.expected_units, query, plan)
    assert ms > 0 and len(merges) == 4
    np.testing.assert_array_equal(ids, shards.search(query, 10)[1][0])
