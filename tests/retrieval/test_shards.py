"""A sharded index: its merged stages equal the unsharded index's, with hidden and added rows."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrag.errors import InvalidInputError, ShardUnavailableError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.shards.added import AddedRows
from specrag.retrieval.backends.shards.build import build_hnsw_shards, build_ivf_shards
from specrag.retrieval.backends.shards.merge import ShardAnswers, ShardedSearcher, owner_shards, split_rows
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import StagePlan, StageResult
from specrag.retrieval.synthetic import GaussianMixture, queries_near
from specrag.retrieval.vector_index import VectorIndex
from tests.helpers.shards import SilentShard
from tests.helpers.vectors import passages_for


def assert_same_stages(first: list[StageResult], second: list[StageResult]) -> None:
    assert [stage.stage for stage in first] == [stage.stage for stage in second]
    for one, other in zip(first, second, strict=True):
        np.testing.assert_array_equal(one.ids, other.ids)
        np.testing.assert_array_equal(one.distances, other.distances)
        assert one.done == other.done


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(200, 1500),
    dim=st.sampled_from([8, 16]),
    shards=st.integers(1, 6),
    codes=st.sampled_from(["flat", "sq8"]),
    k=st.integers(1, 20),
    stages=st.integers(1, 6),
    schedule=st.sampled_from(["equal", "geometric"]),
)
def test_every_merged_ivf_stage_equals_the_unsharded_one(
    seed: int, rows: int, dim: int, shards: int, codes: str, k: int, stages: int, schedule: str
) -> None:
    vectors = GaussianMixture(dim, num_clusters=12, seed=seed).sample(rows)
    queries = queries_near(vectors, 8, seed=seed + 1)
    whole = StagedIVF.build(vectors, nlist=16, nprobe=8, codes=codes, seed=seed)
    sharded = build_ivf_shards(vectors, shards, nlist=16, nprobe=8, codes=codes, seed=seed)
    plan = StagePlan(stages, schedule)
    assert_same_stages(list(sharded.stages(queries, k, plan)), list(whole.stages(queries, k, plan)))
    for merged, single in zip(sharded.search(queries, k), whole.search(queries, k), strict=True):
        np.testing.assert_array_equal(merged, single)


@pytest.fixture(scope="module")
def sharded(vectors: np.ndarray) -> ShardedSearcher:
    return build_ivf_shards(vectors, 3, nlist=64, nprobe=24)


def test_rows_are_split_round_robin_and_every_shard_has_its_own() -> None:
    parts = split_rows(10, 3)
    assert [part.tolist() for part in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert owner_shards(np.arange(10), 3).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(InvalidInputError, match="at least as many rows"):
        split_rows(2, 3)
    with pytest.raises(InvalidInputError, match="at least 1"):
        split_rows(10, 0)


def test_shards_share_one_quantizer_and_hold_every_row_once(
    sharded: ShardedSearcher, vectors: np.ndarray
) -> None:
    assert sharded.ntotal == len(vectors) and len(sharded.shards) == 3
    assert (
        sharded.settings["shards"] == 3 and sharded.settings["quantizer_sha256"] == sharded.quantizer_sha256
    )
    rows, _ = sharded.stored_vectors(np.ones(len(vectors), dtype=bool))
    np.testing.assert_array_equal(rows, np.arange(len(vectors)))


def test_hidden_rows_in_every_shard_are_filtered_as_unsharded(
    sharded: ShardedSearcher, ivf: StagedIVF, vectors: np.ndarray, queries: np.ndarray
) -> None:
    _, nearest = ivf.search(queries[:20], 5)
    hidden = np.unique(nearest[:, :3])  # the best rows of many queries, in all three shards
    assert set(owner_shards(hidden, 3).tolist()) == {0, 1, 2}
    mapping = np.concatenate([np.arange(len(vectors)), [-1]])
    mapping[hidden] = -1
    visibility = Visibility(mapping, len(hidden))
    plan = StagePlan(4, "geometric")
    merged = list(sharded.stages(queries, 10, plan, visibility))
    assert_same_stages(merged, list(ivf.stages(queries, 10, plan, visibility)))
    assert not np.isin(merged[-1].ids, hidden).any()


def test_added_rows_go_to_their_owners_and_search_as_unsharded(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    first, added = vectors[:5000], vectors[5000:5011]
    whole = StagedIVF.build(first, nlist=64, nprobe=24)
    sharded = build_ivf_shards(first, 4, nlist=64, nprobe=24)
    whole.add(added, 5000)
    sharded.add(added, 5000)
    assert sharded.next_row == 5011
    assert [shard.ntotal for shard in sharded.shards] == [1253, 1253, 1253, 1252]  # 5011 round robin
    plan = StagePlan(3, "equal")
    assert_same_stages(list(sharded.stages(queries, 10, plan)), list(whole.stages(queries, 10, plan)))
    with pytest.raises(InvalidInputError, match="start at row 5011"):
        sharded.add(added, 5000)


def test_a_vector_index_over_shards_hides_and_compacts_as_unsharded(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    ids = [passage.id for passage in passages_for(vectors)]
    whole_searcher = StagedIVF.build(vectors, nlist=64, nprobe=24)
    sharded_searcher = build_ivf_shards(vectors, 3, nlist=64, nprobe=24)
    whole, sharded = VectorIndex(whole_searcher, ids), VectorIndex(sharded_searcher, ids)
    retired = list(range(0, 600, 7))
    for index in (whole, sharded):
        index.apply_changes([], np.zeros((0, vectors.shape[1])), [], retired)
    assert_same_stages(list(sharded.search_staged(queries[0], 10)), list(whole.search_staged(queries[0], 10)))
    keep = np.ones(len(vectors), dtype=bool)
    keep[retired] = False
    compact = sharded_searcher.compacted(keep)
    assert compact.ntotal == len(vectors) - len(retired)
    np.testing.assert_array_equal(
        compact.search(queries, 10)[1], whole_searcher.compacted(keep).search(queries, 10)[1]
    )


def test_merged_hnsw_shards_end_on_their_one_shot_search(vectors: np.ndarray, queries: np.ndarray) -> None:
    shards = build_hnsw_shards(vectors[:2000], 2, m=16, ef_search=48)
    final = list(shards.stages(queries[:20], 10, StagePlan(5, "geometric")))[-1]
    _, ids = shards.search(queries[:20], 10)
    np.testing.assert_array_equal(final.ids, ids)
    _, exact = faiss.knn(queries[:20], vectors[:2000], 10, metric=faiss.METRIC_INNER_PRODUCT)
    recall = np.mean([len(set(found) & set(true)) / 10 for found, true in zip(ids, exact, strict=True)])
    assert recall > 0.9


def test_shards_of_different_kinds_or_dimensions_are_refused(vectors: np.ndarray) -> None:
    ivf = build_ivf_shards(vectors[:1000], 2, nlist=8)
    other = build_ivf_shards(np.ascontiguousarray(vectors[:1000, :16]), 2, nlist=8)
    with pytest.raises(InvalidInputError, match="differ"):
        ShardedSearcher([*ivf.shards, *other.shards], None, keep_max=True)


def test_a_one_shot_search_accepting_a_partial_top_k_merges_the_shards_that_answered(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    built = build_ivf_shards(vectors, 3, nlist=32, nprobe=8)
    silent = ShardedSearcher(
        [built.shards[0], SilentShard(built.shards[1]), built.shards[2]], None, built.keep_max
    )
    with pytest.raises(ShardUnavailableError, match="search shard 001"):
        silent.search(queries, 10)
    answers = ShardAnswers()
    distances, ids = silent.search(queries, 10, answers=answers)
    assert answers.answered == ["000", "002"] and list(answers.missing) == ["001"]
    answering = ShardedSearcher([built.shards[0], built.shards[2]], None, built.keep_max)
    expected_distances, expected_ids = answering.search(queries, 10)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(distances, expected_distances)
    assert not np.isin(ids % 3, [1]).any()


@pytest.mark.parametrize("codes", ["flat", "sq8"])
@pytest.mark.parametrize("shards", [2, 3, 4])
def test_ties_at_the_kth_place_merge_as_the_unsharded_index_breaks_them(codes: str, shards: int) -> None:
    """Every vector stored eight times (duplicate documents): every k cuts through a tie, and the
    merge must keep the rows the unsharded index keeps, whatever shard each copy lives on."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((50, 8)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    vectors = np.repeat(base, 8, axis=0)
    rng.shuffle(vectors)
    queries = base[:6] + 0.01
    whole = StagedIVF.build(vectors, nlist=8, nprobe=4, codes=codes)
    sharded = build_ivf_shards(vectors, shards, nlist=8, nprobe=4, codes=codes)
    for k in (3, 5, 10, 12):
        for plan in (StagePlan(1, "equal"), StagePlan(4, "equal")):
            assert_same_stages(list(sharded.stages(queries, k, plan)), list(whole.stages(queries, k, plan)))
        for merged, single in zip(sharded.search(queries, k), whole.search(queries, k), strict=True):
            np.testing.assert_array_equal(merged, single)
        distances, ids = whole.search(queries, k)
        for row_distances, row_ids in zip(distances, ids, strict=True):  # ties: the smaller row first
            for one in range(k - 1):
                if row_distances[one] == row_distances[one + 1]:
                    assert row_ids[one] < row_ids[one + 1]


def test_a_retried_add_records_each_row_once() -> None:
    added = AddedRows(base=10, base_next_row=30, dim=2)
    vectors = np.ones((2, 2), dtype=np.float32)
    added.record(vectors, np.array([30, 33]), 35)
    added.record(vectors, np.array([30, 33]), 35)  # the same add again: its answer was lost
    added.record(vectors[:1], np.array([36]), 37)
    assert added.ntotal == 13 and added.next_row == 37
    _, rows = added.since(10)
    assert rows.tolist() == [30, 33, 36]
    assert added.held_before(36) == 12 and added.held_before(30) == 10
