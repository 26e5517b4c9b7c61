"""A sharded index's shards as actors on a real local Ray: the same stages, a killed shard, and
rows added through the actors (kept across a restart, and given at start).

Ray is started with two CPUs and always shut down; the kill test is bounded in time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specrag.errors import ShardUnavailableError
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.shards.build import build_ivf_shards
from specrag.retrieval.shards.merge import ShardAnswers, ShardedSearcher
from specrag.retrieval.shards.store import save_shards
from specrag.retrieval.staged_ivf import StagedIVF
from specrag.retrieval.stages import StagePlan
from specrag.retrieval.synthetic import GaussianMixture, queries_near

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

PLAN = StagePlan(4, "geometric")


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return GaussianMixture(16, num_clusters=20, seed=3).sample(3000)


@pytest.fixture(scope="module")
def queries(vectors: np.ndarray) -> np.ndarray:
    return queries_near(vectors, 40, seed=4)


@pytest.fixture(scope="module")
def saved(vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The shard directories of a 3-shard SQ8 index, and its manifest's searcher settings."""
    directory = tmp_path_factory.mktemp("ray-shards")
    searcher = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    save_shards(searcher, directory)
    return directory, searcher.settings


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_shard_actors_give_the_in_process_stages(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.service.run.search_actors import search_shards

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    hidden = np.arange(0, 3000, 5)  # rows of every shard
    mapping = np.concatenate([np.arange(3000), [-1]])
    mapping[hidden] = -1
    visibility = Visibility(mapping, len(hidden))
    with search_shards(*saved, num_cpus=0.5, wait_s=30) as remote:
        assert remote.ntotal == 3000 and len(remote.shards) == 3
        for view in (None, visibility):
            far = list(remote.stages(queries, 10, PLAN, view))
            near = list(local.stages(queries, 10, PLAN, view))
            assert [stage.stage for stage in far] == [stage.stage for stage in near]
            for one, other in zip(far, near, strict=True):
                np.testing.assert_array_equal(one.ids, other.ids)
                np.testing.assert_array_equal(one.distances, other.distances)
        assert not np.isin(far[-1].ids, hidden).any()
        np.testing.assert_array_equal(remote.search(queries, 10)[1], local.search(queries, 10)[1])


def test_a_killed_shard_is_restarted_and_no_answer_is_wrong(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.service.run.search_actors import RemoteShard, search_shards

    expected = StagedIVF.build(vectors, nlist=32, nprobe=16, codes="sq8").search(queries, 10)[1]  # exact
    answers: list[tuple[int, np.ndarray]] = []
    failures: list[str] = []
    stop = threading.Event()
    with search_shards(*saved, num_cpus=0.5, wait_s=60) as remote:

        def stream() -> None:
            number = 0
            while not stop.is_set():
                row = number % len(queries)
                try:
                    answers.append((row, list(remote.stages(queries[row], 10, PLAN))[-1].ids[0]))
                except ShardUnavailableError as error:
                    failures.append(str(error))
                number += 1

        worker = threading.Thread(target=stream)
        worker.start()
        try:
            time.sleep(0.5)
            before = len(answers)
            victim = remote.shards[1]
            assert isinstance(victim, RemoteShard)
            victim.kill()
            deadline = time.monotonic() + 120
            while len(answers) < before + 30 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            stop.set()
            worker.join(timeout=120)
    assert len(answers) >= before + 30, f"queries stopped after the kill: {failures}"
    wrong = [row for row, ids in answers if not np.array_equal(ids, expected[row])]
    assert wrong == []
    assert all("search shard 001" in failure for failure in failures)


def test_a_shard_that_does_not_answer_fails_the_search_naming_it_unless_partial(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.service.run.search_actors import RemoteShard, search_shards

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    answering = ShardedSearcher(local.shards[:2], local.quantizer_sha256, local.keep_max)
    with search_shards(*saved, num_cpus=0.5, wait_s=5, max_restarts=0) as remote:
        victim = remote.shards[2]
        assert isinstance(victim, RemoteShard)
        ray.kill(victim.actor, no_restart=True)
        with pytest.raises(ShardUnavailableError, match="search shard 002"):
            list(remote.stages(queries[0], 10, PLAN))
        answers = ShardAnswers()
        partial = list(remote.stages(queries[0], 10, PLAN, answers=answers))
    assert answers.answered == ["000", "001"] and list(answers.missing) == ["002"]
    assert "search shard 002" in answers.missing["002"]
    expected = list(answering.stages(queries[0], 10, PLAN))[-1]
    np.testing.assert_array_equal(partial[-1].ids, expected.ids)
    assert partial[-1].done


def restarted(shard: Any) -> Any:
    """What the actor of ``shard``, killed, reports once Ray has restarted it (bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            info = ray.get(shard.actor.info.remote(), timeout=30)
        except ray.exceptions.RayError:
            continue
        if info.pid != shard.info.pid:
            return info
        time.sleep(0.1)
    raise AssertionError(f"search shard {shard.name} was not restarted")


def test_added_rows_are_found_through_the_actors_after_a_restart_and_at_start(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.service.run.search_actors import RemoteShard, search_shards

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    new = queries[:6] * 10  # each new row tops its query's search (inner product)
    local.add(new, 3000)
    expected = list(local.stages(queries, 10, PLAN))[-1].ids
    assert [int(ids[0]) for ids in expected[:6]] == list(range(3000, 3006))

    def found(remote: ShardedSearcher) -> np.ndarray:
        return list(remote.stages(queries, 10, PLAN))[-1].ids

    with search_shards(*saved, num_cpus=0.5, wait_s=60) as remote:
        remote.add(new, 3000)  # two rows to each shard: row r to shard r % 3
        assert remote.ntotal == 3006 and remote.next_row == 3006
        np.testing.assert_array_equal(found(remote), expected)
        for shard in remote.shards:  # restarted from their files, which lack the added rows
            assert isinstance(shard, RemoteShard)
            shard.kill()
            assert restarted(shard).ntotal == 1000
        np.testing.assert_array_equal(found(remote), expected)
        np.testing.assert_array_equal(remote.search(queries, 10)[1], local.search(queries, 10)[1])
        added = [shard.added for shard in remote.shards if isinstance(shard, RemoteShard)]
    # A start after documents were added (the live log replayed onto the shards' manifests).
    with search_shards(*saved, num_cpus=0.5, wait_s=60, added=added) as remote:
        assert remote.ntotal == 3006
        np.testing.assert_array_equal(found(remote), expected)
