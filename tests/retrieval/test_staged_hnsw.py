from __future__ import annotations

import faiss
import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.search.stages import StagePlan


@pytest.mark.parametrize(
    "plan",
    [
        StagePlan(1, "equal"),
        StagePlan(4, "equal"),
        StagePlan(16, "equal"),
        StagePlan(4, schedule="geometric"),
        StagePlan.budget(2e-5),
    ],
)
def test_final_stage_equals_faiss_exactly(hnsw: StagedHNSW, queries: np.ndarray, plan: StagePlan) -> None:
    distances, ids = hnsw.search(queries, 10)
    final = list(hnsw.stages(queries, 10, plan))[-1]
    assert final.done
    np.testing.assert_array_equal(final.ids, ids)
    np.testing.assert_allclose(final.distances, distances, rtol=1e-5, atol=1e-5)


def test_l2_metric_matches_faiss(vectors: np.ndarray, queries: np.ndarray) -> None:
    l2 = StagedHNSW.build(vectors[:2000], metric=faiss.METRIC_L2, m=8, ef_search=32)
    np.testing.assert_array_equal(
        list(l2.stages(queries, 5, StagePlan(3, "equal")))[-1].ids, l2.search(queries, 5)[1]
    )


def test_stages_are_numbered_and_only_the_last_is_done(hnsw: StagedHNSW, queries: np.ndarray) -> None:
    stages = list(hnsw.stages(queries[:4], 10, StagePlan(4, "equal")))
    assert [s.stage for s in stages] == list(range(1, len(stages) + 1))
    assert 2 <= len(stages) <= 4
    assert [s.done for s in stages] == [False] * (len(stages) - 1) + [True]


def test_k_larger_than_the_index_pads_with_minus_one(queries: np.ndarray) -> None:
    tiny = StagedHNSW.build(np.eye(32, dtype=np.float32)[:6], m=4, ef_search=8)
    final = list(tiny.stages(queries[:2], 10, StagePlan(2, "equal")))[-1]
    assert (final.ids[:, :6] >= 0).all() and (final.ids[:, 6:] == -1).all()
    np.testing.assert_array_equal(final.ids, tiny.search(queries[:2], 10)[1])


def test_empty_and_wrong_dimension(hnsw: StagedHNSW) -> None:
    with pytest.raises(InvalidInputError, match="zero vectors"):
        StagedHNSW.build(np.zeros((0, 8), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="dimension"):
        hnsw.stages(np.zeros(7, dtype=np.float32), 3, StagePlan(4, "equal"))
