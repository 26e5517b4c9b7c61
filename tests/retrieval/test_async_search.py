from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import faiss
import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import DEFAULT_STAGES, Capabilities, StagePlan, StageResult
from specrag.retrieval.vector_index import VectorIndex


def make_index(ivf: StagedIVF, runner: SearchRunner | None = None) -> VectorIndex:
    return VectorIndex(ivf, [f"p{i}" for i in range(ivf.ntotal)], runner=runner)


class GatedSearcher:
    """Wraps a searcher so each stage after the first waits for the test's permission."""

    def __init__(self, inner: StagedIVF) -> None:
        self.inner = inner
        self.kind, self.dim, self.ntotal, self.settings = inner.kind, inner.dim, inner.ntotal, inner.settings
        self.capabilities = Capabilities()  # its stages take no visibility
        self.computed: list[int] = []
        self.gate = threading.Event()

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.search(queries, k)

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]:
        for stage in self.inner.stages(queries, k, plan):
            self.computed.append(stage.stage)
            yield stage
            assert self.gate.wait(timeout=30)


async def test_async_stages_equal_sync_stages(ivf: StagedIVF, queries: np.ndarray) -> None:
    index = make_index(ivf)
    received = [stage async for stage in index.search_staged(queries[0], 10, StagePlan(4, "equal"))]
    expected = list(index.search_staged(queries[0], 10, StagePlan(4, "equal")))
    assert [s.stage for s in received] == [1, 2, 3, 4]
    for got, want in zip(received, expected, strict=True):
        np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(received[-1].ids, ivf.search(queries[0], 10)[1][0])


async def test_batch_variant_matches_one_shot(ivf: StagedIVF, queries: np.ndarray) -> None:
    index = make_index(ivf, SearchRunner(threads=1, cpus=[0]))
    stages = [stage async for stage in index.search_staged(queries, 10, index.stage_plan(3), batch=True)]
    assert stages[-1].done and stages[-1].ids.shape == (len(queries), 10)
    np.testing.assert_array_equal(stages[-1].ids, ivf.search(queries, 10)[1])


async def test_breaking_out_stops_the_remaining_stages(ivf: StagedIVF, queries: np.ndarray) -> None:
    gated = GatedSearcher(ivf)
    runner = SearchRunner()
    index = VectorIndex(gated, [f"p{i}" for i in range(ivf.ntotal)], runner=runner)  # type: ignore[arg-type]
    async with contextlib.aclosing(index.search_staged(queries[0], 10, index.stage_plan(8))) as stages:
        async for stage in stages:
            assert stage.stage == 1
            break
    gated.gate.set()
    runner.shutdown()
    # Stage 2 may have been in flight when the consumer left; nothing after it ran.
    assert gated.computed in ([1], [1, 2])


async def test_cancelling_the_task_stops_the_remaining_stages(ivf: StagedIVF, queries: np.ndarray) -> None:
    gated = GatedSearcher(ivf)
    runner = SearchRunner()
    index = VectorIndex(gated, [f"p{i}" for i in range(ivf.ntotal)], runner=runner)  # type: ignore[arg-type]
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in index.search_staged(queries[0], 10, index.stage_plan(8)):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gated.gate.set()
    runner.shutdown()
    assert gated.computed in ([1], [1, 2])


async def test_errors_reach_the_consumer(ivf: StagedIVF, queries: np.ndarray) -> None:
    index = make_index(ivf)
    with pytest.raises(InvalidInputError, match="dimension"):
        async for _ in index.search_staged(np.zeros(5, dtype=np.float32), 3):
            pass
    with pytest.raises(InvalidInputError, match="one query"):
        async for _ in index.search_staged(queries[:2], 3):
            pass


async def test_worker_failures_are_raised_in_the_consumer() -> None:
    def failing() -> Iterator[StageResult]:
        yield StageResult(1, np.zeros(1), np.zeros(1), False, 0.0)
        raise RuntimeError("boom")

    runner = SearchRunner()
    with pytest.raises(RuntimeError, match="boom"):
        async for _ in runner.stream(failing):
            pass
    runner.shutdown()


def test_runner_rejects_unknown_cores() -> None:
    with pytest.raises(InvalidInputError, match="cpu set"):
        SearchRunner(cpus=[10_000])


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own scheduling policy is Linux's")
@pytest.mark.parametrize(
    ("cpus", "idle", "policy"),
    [
        ([0], None, os.SCHED_IDLE),
        (None, None, os.SCHED_OTHER),
        (None, True, os.SCHED_IDLE),
        ([0], False, os.SCHED_OTHER),
    ],
    ids=["pinned", "unpinned", "told-idle", "told-not"],
)
async def test_pinned_search_threads_give_way_to_the_event_loop(
    cpus: list[int] | None, idle: bool | None, policy: int
) -> None:
    """A pinned search thread of normal policy kept the core it shares with the event loop for its
    time slice while the woken loop waited to submit a speculation; one of idle policy yields at
    once. Unpinned, it keeps the process's policy (an engine spinning on its cores would starve an
    idle-policy search). The event loop's own thread keeps its policy."""
    loop_policy = os.sched_getscheduler(0)
    runner = SearchRunner(cpus=cpus, idle=idle)
    seen: list[int] = []

    def probe() -> Iterator[StageResult]:
        seen.append(os.sched_getscheduler(0))
        yield StageResult(1, np.zeros(1), np.zeros(1), True, 0.0)

    async for _ in runner.stream(probe):
        pass
    runner.shutdown()
    assert seen == [policy]
    assert os.sched_getscheduler(0) == loop_policy


async def test_a_search_told_not_to_learn_leaves_the_stage_statistics_alone(
    ivf: StagedIVF, queries: np.ndarray
) -> None:
    index = make_index(ivf)
    plan = StagePlan(3, "equal")
    quiet = index.search_staged(queries[0], 10, plan, learn=False)
    async for _ in quiet:
        pass
    assert quiet.outlook(1, 0.0).observed == 0
    taught = index.search_staged(queries[0], 10, plan)
    async for _ in taught:
        pass
    assert taught.outlook(1, 0.0).observed == 1


async def search_thread_settings(runner: SearchRunner) -> tuple[int, set[int]]:
    """faiss's thread count and the cores as seen from inside the runner's search thread."""
    seen: list[tuple[int, set[int]]] = []

    def probe() -> Iterator[StageResult]:
        seen.append((faiss.omp_get_max_threads(), os.sched_getaffinity(0)))
        yield StageResult(1, np.zeros(1), np.zeros(1), True, 0.0)

    async for _ in runner.stream(probe):
        pass
    runner.shutdown()
    return seen[0]


@pytest.mark.parametrize(
    ("threads", "cpus", "expected_threads"),
    [(1, None, 1), (None, None, 1), (None, [0], 1), (2, [0], 2)],
)
async def test_the_thread_count_applies_inside_the_search_thread(
    threads: int | None, cpus: list[int] | None, expected_threads: int
) -> None:
    # OpenMP keeps the count per thread: set only where the runner is made, a pinned search
    # thread ran one OpenMP thread per machine core on its one core, 2-3x slower.
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    count, cores = await search_thread_settings(SearchRunner(threads=threads, cpus=cpus))
    assert count == expected_threads
    assert cores == (set(cpus) if cpus else os.sched_getaffinity(0))


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
async def test_a_search_without_a_stage_count_takes_its_kinds_default(
    kind: str, request: pytest.FixtureRequest, queries: np.ndarray
) -> None:
    searcher = request.getfixturevalue(kind)
    index = VectorIndex(searcher, [f"p{i}" for i in range(searcher.ntotal)])
    assert index.default_stages == DEFAULT_STAGES[kind]
    # A direct caller gets the kind's count and the schedule that measured best, as the service.
    assert index.stage_plan() == StagePlan(DEFAULT_STAGES[kind], "geometric")
    received = [stage async for stage in index.search_staged(queries[0], 10)]
    # A geometric IVF search has work for every stage; a graph search may converge before its last.
    if kind == "ivf":
        assert len(received) == DEFAULT_STAGES[kind]
    assert 1 <= len(received) <= DEFAULT_STAGES[kind] and received[-1].done
    np.testing.assert_array_equal(received[-1].ids, searcher.search(queries[0], 10)[1][0])


@pytest.mark.parametrize("stages", [1, 4])
async def test_a_search_hands_the_loop_its_stages_and_no_end_marker_after_the_last(
    ivf: StagedIVF, queries: np.ndarray, monkeypatch: pytest.MonkeyPatch, stages: int
) -> None:
    """Each hand-off from the search thread wakes the loop's thread; the last stage says it is
    the last (``done``), so the stream ends on it."""
    loop = asyncio.get_running_loop()
    handed: list[object] = []
    hand = loop.call_soon_threadsafe

    def counting(callback: object, *args: object) -> asyncio.Handle:
        handed.append(args[0] if args else callback)
        return hand(callback, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    received = [
        stage async for stage in make_index(ivf).search_staged(queries[0], 10, StagePlan(stages, "equal"))
    ]
    assert [stage.stage for stage in received] == list(range(1, stages + 1)) and received[-1].done
    assert [getattr(item, "stage", item) for item in handed] == [stage.stage for stage in received]
