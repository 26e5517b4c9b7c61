"""``serve --ray --search-shards N``: the flags' checks, the shard count checked against the index,
and an index that searches through shard actors on a real local Ray (Ray always shut down)."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from specrag.cli import build_parser, main
from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.registry import chosen
from specrag.retrieval.backends.shards.build import build_ivf_shards
from specrag.retrieval.backends.shards.store import save_shards, shard_manifests
from specrag.retrieval.search.stages import StagePlan
from specrag.retrieval.synthetic import GaussianMixture, queries_near
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.options import ServiceOptions
from specrag.service.run.sharded_serving import check_search_shards, searching_on_shards, shard_cpus
from tests.helpers.vectors import passages_for


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return GaussianMixture(16, num_clusters=10, seed=5).sample(1200)


def index_over(searcher: object, vectors: np.ndarray) -> VectorIndex:
    return VectorIndex(searcher, [p.id for p in passages_for(vectors)])  # type: ignore[arg-type]


def found(index: VectorIndex, query: np.ndarray) -> np.ndarray:
    ids: np.ndarray = list(index.search_staged(query, 5, StagePlan(3, "equal")))[-1].ids
    return ids


def read_nothing(*args: object) -> None:
    raise AssertionError("the serving process read a shard's vectors")


def served(*flags: str) -> None:
    """The shards backend's check of ``serve``'s flags (the registry's lookup)."""
    chosen(build_parser().parse_args(["serve", *flags]))


def test_search_shards_need_ray_and_a_positive_count() -> None:
    with pytest.raises(InvalidInputError, match="give --ray too"):
        served("--search-shards", "2")
    with pytest.raises(InvalidInputError, match="at least 1"):
        served("--ray", "--search-shards", "0")


def test_serve_without_ray_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(tmp_path), "serve", "--search-shards", "2"]) == 2
    assert "--search-shards places the shards as Ray actors" in capsys.readouterr().err


def test_the_shard_count_is_checked_against_the_index(vectors: np.ndarray) -> None:
    with pytest.raises(InvalidInputError, match="is not sharded"):
        check_search_shards(index_over(StagedIVF.build(vectors, nlist=8), vectors), 2, "DIR")
    sharded = index_over(build_ivf_shards(vectors, 3, nlist=8), vectors)
    with pytest.raises(InvalidInputError, match="has 3 shards"):
        check_search_shards(sharded, 2, "DIR")
    assert check_search_shards(sharded, 3, "DIR")["shards"] == 3


@pytest.mark.timeout(300)
def test_the_index_searches_through_shard_actors_while_serving(
    vectors: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    local = build_ivf_shards(vectors, 2, nlist=16, nprobe=8, codes="sq8")
    save_shards(local, tmp_path)
    queries = queries_near(vectors, 5, seed=6)
    expected = [
        list(index_over(local, vectors).search_staged(query, 5, StagePlan(3, "equal")))[-1].ids
        for query in queries
    ]
    # The serving process holds the shards' manifests and never reads a shard's vectors: the
    # actors (other processes, which this patch does not reach) load them.
    monkeypatch.setattr(faiss, "read_index", read_nothing)
    manifests = shard_manifests(tmp_path, local.settings, 16, keep_max=True)
    index = index_over(manifests, vectors)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        options = ServiceOptions(ray_address="", search_shards=2, index_dir=str(tmp_path))
        with searching_on_shards(index, options) as health:
            assert index.searcher is not manifests and index.searcher.settings["shards"] == 2
            assert health is not None and [shard["state"] for shard in health()] == ["serving"] * 2
            for query, ids in zip(queries, expected, strict=True):
                np.testing.assert_array_equal(
                    list(index.search_staged(query, 5, StagePlan(3, "equal")))[-1].ids, ids
                )
            # A document added while serving goes to its shard's actor and is found at once.
            (row,) = index.apply_changes(["new"], queries[:1] * 10, ["text"], [])
            assert row == 1200 and found(index, queries[0])[0] == row
            index.apply_changes(
                [], np.zeros((0, 16)), [], [int(expected[0][0])]
            )  # a delete: hidden in every shard
            hidden = list(index.search_staged(queries[0], 5, StagePlan(3, "equal")))[-1].ids
            assert int(expected[0][0]) not in hidden.tolist()
        assert index.searcher is manifests and manifests.ntotal == 1201
        # A start after it was added (the live log replays it onto the manifests): its actor gets it.
        with searching_on_shards(index, options):
            assert found(index, queries[0])[0] == 1200
        monkeypatch.undo()
        index = index_over(local, vectors)
        local.add(vectors[:1], 1200)  # added to shards loaded in this process: not the actors'
        with (
            pytest.raises(InvalidInputError, match="added to shards loaded in this process"),
            searching_on_shards(index, options),
        ):
            pass
        wrong = ServiceOptions(ray_address="", search_shards=4, index_dir="DIR")
        with pytest.raises(InvalidInputError, match="has 2 shards"), searching_on_shards(index, wrong):
            pass
    finally:
        ray.shutdown()


def test_pgvector_with_search_shards_exits_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--data-dir", str(tmp_path), "serve", "--port", "0", "--ray", "--search-shards", "2"]
    assert main([*argv, "--backend", "pgvector", "--pg-dsn", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    error = capsys.readouterr().err
    assert "--search-shards" in error and "--backend pgvector" in error
    assert not (tmp_path / "index").exists()  # refused before any artefact or database


@pytest.mark.parametrize(
    ("shards", "replicas", "cluster", "given", "cpus"),
    [
        (2, 1, {"CPU": 2.0}, None, 0.5),  # the documented local start: one core for the engine
        (4, 1, {"CPU": 2.0}, None, 0.25),
        (3, 1, {"CPU": 2.0}, None, 0.33),
        (2, 1, {"CPU": 8.0}, None, 1.0),  # room for a core each
        (2, 2, {"CPU": 2.0, "GPU": 2.0}, None, 1.0),  # the replicas take GPUs, not CPUs
        (2, 1, {"CPU": 2.0}, 0.2, 0.2),
        (2, 2, {"CPU": 2.0}, 0.0, 0.0),  # shares the replicas' cores, reserving none
    ],
)
def test_shard_actors_ask_for_what_the_cluster_has_beside_the_engines(
    shards: int, replicas: int, cluster: dict[str, float], given: float | None, cpus: float
) -> None:
    options = ServiceOptions(ray_address="", search_shards=shards, replicas=replicas, search_shard_cpus=given)
    assert shard_cpus(options, cluster) == cpus


def test_a_shard_placement_ray_could_never_satisfy_is_refused_naming_the_flag() -> None:
    crowded = ServiceOptions(ray_address="", search_shards=2, replicas=2)
    with pytest.raises(InvalidInputError, match="all go to the 2 engine replica") as failure:
        shard_cpus(crowded, {"CPU": 2.0})
    assert "--search-shard-cpus 0" in str(failure.value)
    greedy = ServiceOptions(ray_address="", search_shards=2, search_shard_cpus=1.0)
    with pytest.raises(InvalidInputError, match="need 3 CPUs, the cluster has 2") as failure:
        shard_cpus(greedy, {"CPU": 2.0})
    assert "--search-shard-cpus 0.5 or less" in str(failure.value)
    with pytest.raises(InvalidInputError, match="give --search-shards too"):
        served("--ray", "--search-shard-cpus", "0.5")
    with pytest.raises(InvalidInputError, match="0 or more"):
        served("--ray", "--search-shards", "2", "--search-shard-cpus", "nan")
