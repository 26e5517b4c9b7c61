"""A sharded index's shards as actors on a real local Ray: the same stages, a killed shard, a
stopped one, one Ray gave up on (replaced), rows added through the actors (kept across a restart,
given at start, added once when sent twice), and placements Ray cannot satisfy.

Ray is started with two CPUs and always shut down; the kill test is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specrag.errors import ShardUnavailableError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.shards.build import build_ivf_shards
from specrag.retrieval.backends.shards.merge import ShardAnswers, ShardedSearcher
from specrag.retrieval.backends.shards.store import save_shards
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.search.stages import StagePlan
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
    from specrag.retrieval.backends.shards.search_actors import search_shards

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
    from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards

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


@contextlib.contextmanager
def stopped(shard: Any) -> Iterator[None]:
    """The shard's actor process stopped (SIGSTOP: alive, answering nothing) within the block."""
    os.kill(shard.info.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(shard.info.pid, signal.SIGCONT)


def test_a_shard_that_does_not_answer_fails_the_search_naming_it_unless_partial(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards
    from specrag.retrieval.backends.shards.shard_actor import ShardState

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    answering = ShardedSearcher(local.shards[:2], local.quantizer_sha256, local.keep_max)
    with search_shards(*saved, num_cpus=0.5, wait_s=5, probe_every_s=600) as remote:
        victim = remote.shards[2]
        assert isinstance(victim, RemoteShard)
        with stopped(victim):
            with pytest.raises(ShardUnavailableError, match="search shard 002 did not answer"):
                list(remote.stages(queries[0], 10, PLAN))
            assert victim.state is ShardState.UNRESPONSIVE
            answers = ShardAnswers()
            partial = list(remote.stages(queries[0], 10, PLAN, answers=answers))
    assert answers.answered == ["000", "001"] and list(answers.missing) == ["002"]
    assert "search shard 002" in answers.missing["002"]
    expected = list(answering.stages(queries[0], 10, PLAN))[-1]
    np.testing.assert_array_equal(partial[-1].ids, expected.ids)
    assert partial[-1].done


def test_searches_abandoned_by_a_timeout_are_cancelled_not_run_later(
    local_ray: None, saved: tuple[Path, dict[str, Any]], queries: np.ndarray
) -> None:
    from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards

    with search_shards(*saved, num_cpus=0.5, wait_s=2, probe_every_s=600) as remote:
        victim = remote.shards[0]
        assert isinstance(victim, RemoteShard)
        before = ray.get(victim.actor.info.remote(), timeout=60).searches
        with stopped(victim):
            for query in queries[:6]:
                with pytest.raises(ShardUnavailableError, match="did not answer within 2s"):
                    victim.search(query[None, :], 10)
        after = ray.get(victim.actor.info.remote(), timeout=60).searches
    assert after == before  # none ran: each had passed its deadline when the process went on


def test_an_add_sent_again_after_its_answer_was_lost_adds_each_row_once(
    local_ray: None,
    saved: tuple[Path, dict[str, Any]],
    vectors: np.ndarray,
    queries: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray.exceptions import GetTimeoutError

    from specrag.retrieval.backends.shards.search_actors import search_shards

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    new = queries[:6] * 10  # each new row tops its query's search (inner product)
    local.add(new, 3000)
    expected = list(local.stages(queries, 10, PLAN))[-1].ids
    real_get = ray.get
    lost = [1]  # the first add's answer: the actor added the rows, the caller never heard

    def get_losing_an_answer(reference: Any, timeout: float | None = None) -> Any:
        result = real_get(reference, timeout=timeout)
        if lost and type(result) is int:  # an add's answer: the rows the actor holds
            lost.pop()
            raise GetTimeoutError("lost")
        return result

    with search_shards(*saved, num_cpus=0.5, wait_s=60, probe_every_s=600) as remote:
        monkeypatch.setattr(ray, "get", get_losing_an_answer)
        with pytest.raises(ShardUnavailableError, match="search shard 000"):
            remote.add(new, 3000)
        remote.add(new, 3000)  # what a retried change does: the same rows from the same row
        monkeypatch.undo()
        assert remote.ntotal == 3006
        assert [shard.ntotal for shard in remote.shards] == [1002, 1002, 1002]
        infos = [ray.get(shard.actor.info.remote(), timeout=60) for shard in remote.shards]  # type: ignore[attr-defined]
        assert [info.ntotal for info in infos] == [1002, 1002, 1002]
        np.testing.assert_array_equal(list(remote.stages(queries, 10, PLAN))[-1].ids, expected)


def test_an_actor_ray_gave_up_on_is_replaced_and_health_names_every_shard(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards
    from specrag.service.run.sharded_serving import shards_health

    local = build_ivf_shards(vectors, 3, nlist=32, nprobe=16, codes="sq8")
    new = queries[:6] * 10
    local.add(new, 3000)
    expected = list(local.stages(queries, 10, PLAN))[-1].ids
    with search_shards(*saved, num_cpus=0.5, wait_s=30, max_restarts=0, probe_every_s=0.5) as remote:
        remote.add(new, 3000)
        assert [shard["state"] for shard in shards_health(remote)] == ["serving"] * 3
        victim = remote.shards[1]
        assert isinstance(victim, RemoteShard)
        dead_pid = victim.info.pid
        victim.kill()  # no restarts left: Ray gives up on it at once
        deadline = time.monotonic() + 120
        states = []
        while time.monotonic() < deadline and victim.replacements == 0:  # no query: the watcher notices
            states.append(victim.state.value)
            time.sleep(0.1)
        assert victim.replacements == 1 and victim.info.pid != dead_pid, states
        assert "replacing" in states
        health = shards_health(remote)
        assert [shard["name"] for shard in health] == ["000", "001", "002"]
        assert [shard["state"] for shard in health] == ["serving"] * 3
        assert health[1]["replacements"] == 1 and health[1]["rows"] == 1002
        np.testing.assert_array_equal(list(remote.stages(queries, 10, PLAN))[-1].ids, expected)


def test_a_placement_ray_cannot_satisfy_is_said_within_seconds(
    local_ray: None, saved: tuple[Path, dict[str, Any]]
) -> None:
    from specrag.retrieval.backends.shards.search_actors import search_shards

    started = time.monotonic()
    with (
        pytest.raises(ShardUnavailableError) as failure,
        search_shards(*saved, num_cpus=1.5, place_s=5),  # the second shard's 1.5 CPUs are never free
    ):
        pass
    message = str(failure.value)
    # Ray places the three in any order: one of them is left waiting.
    assert re.search(r"search shard 00[0-2] could not be placed within 5s", message)
    assert "it asks for 1.5 CPU, the cluster has 0.5 of 2 free" in message
    assert "--search-shard-cpus" in message
    assert time.monotonic() - started < 120


def test_an_engine_replica_ray_cannot_place_is_said_within_seconds(local_ray: None) -> None:
    from specrag.errors import EngineError
    from specrag.pipeline.engines.config import EngineConfig
    from specrag.pipeline.engines.ray_engine import RayEngine

    holder = ray.remote(num_cpus=2)(_Holder).remote()  # every CPU of the local Ray
    try:
        ray.get(holder.ready.remote(), timeout=120)
        with pytest.raises(EngineError, match="engine replica r0 could not be placed within 3s") as failure:
            asyncio.run(RayEngine.start(EngineConfig(model="never-loaded"), "r0", place_s=3))
        assert "it asks for 1 CPU, the cluster has 0 of 2 free" in str(failure.value)
        assert "--search-shard-cpus" in str(failure.value)
    finally:
        ray.kill(holder, no_restart=True)


class _Holder:
    def ready(self) -> bool:
        return True


def restarted(shard: Any, pid: int) -> Any:
    """What the actor of ``shard``, killed in process ``pid``, reports once Ray has restarted it
    (bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            info = ray.get(shard.actor.info.remote(), timeout=30)
        except ray.exceptions.RayError:
            continue
        if info.pid != pid:
            return info
        time.sleep(0.1)
    raise AssertionError(f"search shard {shard.name} was not restarted")


def test_added_rows_are_found_through_the_actors_after_a_restart_and_at_start(
    local_ray: None, saved: tuple[Path, dict[str, Any]], vectors: np.ndarray, queries: np.ndarray
) -> None:
    from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards

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
            pid = shard.info.pid
            shard.kill()
            assert restarted(shard, pid).ntotal == 1000
        np.testing.assert_array_equal(found(remote), expected)
        np.testing.assert_array_equal(remote.search(queries, 10)[1], local.search(queries, 10)[1])
        added = [shard.added for shard in remote.shards if isinstance(shard, RemoteShard)]
    # A start after documents were added (the live log replayed onto the shards' manifests).
    with search_shards(*saved, num_cpus=0.5, wait_s=60, added=added) as remote:
        assert remote.ntotal == 3006
        np.testing.assert_array_equal(found(remote), expected)
