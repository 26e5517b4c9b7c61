from __future__ import annotations

import itertools

import faiss
import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF, choose_nlist
from specrag.retrieval.search.stages import StagePlan


@pytest.mark.parametrize(
    "plan",
    [
        StagePlan(1, "equal"),
        StagePlan(2, "equal"),
        StagePlan(4, "equal"),
        StagePlan(7, "equal"),
        StagePlan(4, schedule="geometric"),
        StagePlan(7, schedule="geometric"),
        StagePlan.budget(1e-5),
    ],
)
def test_final_stage_equals_one_shot(ivf: StagedIVF, queries: np.ndarray, plan: StagePlan) -> None:
    distances, ids = ivf.search(queries, 10)
    stages = list(ivf.stages(queries, 10, plan))
    np.testing.assert_array_equal(stages[-1].ids, ids)
    np.testing.assert_array_equal(stages[-1].distances, distances)


def test_single_query_stages_equal_single_query_search(ivf: StagedIVF, queries: np.ndarray) -> None:
    for query in queries[:50]:
        _, ids = ivf.search(query, 5)
        np.testing.assert_array_equal(list(ivf.stages(query, 5, StagePlan(4, "equal")))[-1].ids, ids)


def test_stages_are_numbered_and_only_the_last_is_done(ivf: StagedIVF, queries: np.ndarray) -> None:
    stages = list(ivf.stages(queries[:3], 10, StagePlan(4, "equal")))
    assert [s.stage for s in stages] == [1, 2, 3, 4]
    assert [s.done for s in stages] == [False, False, False, True]


def test_running_top_k_only_improves(ivf: StagedIVF, queries: np.ndarray) -> None:
    stages = list(ivf.stages(queries, 10, StagePlan(6, "equal")))
    for earlier, later in itertools.pairwise(stages):
        assert (later.distances >= earlier.distances).all()  # inner products: larger is better


def test_fewer_probes_than_stages_ends_early(vectors: np.ndarray, queries: np.ndarray) -> None:
    small = StagedIVF.build(vectors, nlist=16, nprobe=2)
    stages = list(small.stages(queries, 10, StagePlan(8, "equal")))
    assert [s.stage for s in stages] == [1, 2] and stages[-1].done
    np.testing.assert_array_equal(stages[-1].ids, small.search(queries, 10)[1])


def test_k_larger_than_the_index_pads_with_minus_one(queries: np.ndarray) -> None:
    tiny = StagedIVF.build(np.eye(8, dtype=np.float32), nlist=4, nprobe=4)
    result = list(tiny.stages(queries[:2, :8], 20, StagePlan(2, "equal")))[-1]
    assert result.ids.shape == (2, 20)
    assert (result.ids[:, 8:] == -1).all() and (result.ids[:, :8] >= 0).all()
    np.testing.assert_array_equal(result.ids, tiny.search(queries[:2, :8], 20)[1])


def test_empty_index_is_a_clear_error(queries: np.ndarray) -> None:
    with pytest.raises(InvalidInputError, match="zero vectors"):
        StagedIVF.build(np.zeros((0, 32), dtype=np.float32))
    trained = faiss.IndexIVFFlat(faiss.IndexFlatIP(32), 32, 1, faiss.METRIC_INNER_PRODUCT)
    trained.train(queries)
    with pytest.raises(InvalidInputError, match="empty"):
        list(StagedIVF(trained).stages(queries, 5, StagePlan(2, "equal")))


@pytest.mark.parametrize("bad", [np.zeros(31), np.zeros((2, 33)), np.zeros((0, 32)), np.full(32, np.nan)])
def test_wrong_queries_are_rejected(ivf: StagedIVF, bad: np.ndarray) -> None:
    with pytest.raises(InvalidInputError):
        ivf.stages(bad, 5, StagePlan(2, "equal"))
    with pytest.raises(InvalidInputError):
        ivf.search(bad, 5)


def test_invalid_plans_and_k_are_rejected(ivf: StagedIVF, queries: np.ndarray) -> None:
    with pytest.raises(InvalidInputError):
        StagePlan(0, "equal")
    with pytest.raises(InvalidInputError):
        StagePlan.budget(0)
    with pytest.raises(InvalidInputError, match="stage schedule"):
        StagePlan(4, schedule="exponential")
    with pytest.raises(InvalidInputError):
        ivf.stages(queries, 0, StagePlan(4, "equal"))


@pytest.mark.parametrize("codes", ["pq", "sq8"])
def test_quantized_ivf_final_stage_equals_one_shot(
    vectors: np.ndarray, queries: np.ndarray, codes: str
) -> None:
    quantized = StagedIVF.build(np.tile(vectors, (2, 1)), nlist=16, nprobe=8, codes=codes, pq_m=8)
    np.testing.assert_array_equal(
        list(quantized.stages(queries, 10, StagePlan(3, "equal")))[-1].ids, quantized.search(queries, 10)[1]
    )


def test_nlist_is_capped_for_small_corpora() -> None:
    assert choose_nlist(1600, 1024) == 41
    assert choose_nlist(10, 1024) == 1
    assert choose_nlist(10**6, 1024) == 1024
