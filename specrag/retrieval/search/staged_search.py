"""One staged search, not started yet: its stages run in the caller's thread or on the search
threads, and a single query's search teaches the stage statistics it was planned under."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator

from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stage_stats import PlanKey, StageOutlook, StageStatistics
from specrag.retrieval.search.stages import StageResult

__all__ = ["StagedSearch"]


class StagedSearch:
    """One staged search of an index, made by ``VectorIndex.search_staged``.

    Iterated with ``for``, its stages are computed in the calling thread (scripts, benchmarks);
    with ``async for``, on the index's search threads. Leaving an ``async for`` (use
    ``contextlib.aclosing`` on the search to make it immediate) or cancelling the task stops the
    search after the stage in flight.

    The index's stage statistics (:mod:`specrag.retrieval.search.stage_stats`) have one writer and one
    reader, both here: a single query's search on the search threads (the service's) records its
    stages once the last one is known, and :meth:`outlook` reads what the searches of the same plan
    taught, under the key of the plan the caller resolved. They live with the index, so what it
    taught outlives a controller rebuilt around it (``bench.e2e`` builds one per configuration).
    """

    def __init__(
        self,
        runner: Callable[[], SearchRunner],
        stages: Callable[[], Iterator[StageResult]],
        stats: StageStatistics,
        key: PlanKey,
        single: bool,
        learn: bool,
    ) -> None:
        self._runner = runner  # the index's search threads, as they are when an ``async for`` starts
        self._stages = stages  # batch-shaped stages, computed when called
        self._stats = stats
        self._key = key
        self._single = single  # a batch's results are 2-D and not learned from
        self._learn = learn
        self._running: AsyncGenerator[StageResult, None] | None = None

    def __iter__(self) -> Iterator[StageResult]:
        stages = self._stages()
        return (stage.for_query(0) for stage in stages) if self._single else stages

    def __aiter__(self) -> AsyncGenerator[StageResult, None]:
        if self._running is None:
            self._running = self._stream()
        return self._running

    async def aclose(self) -> None:
        """Stop the search after the stage in flight (what ``contextlib.aclosing`` calls)."""
        if self._running is not None:
            await self._running.aclose()

    async def _stream(self) -> AsyncGenerator[StageResult, None]:
        seen: list[StageResult] = []
        async with contextlib.aclosing(self._runner().stream(self._stages)) as stages:
            async for stage in stages:
                if not self._single:
                    yield stage
                    continue
                seen.append(stage.for_query(0))
                # Learned before the caller sees the end (it may stop reading there).
                if stage.done and self._learn:
                    self._stats.record(self._key, seen)
                yield seen[-1]

    @property
    def num_stages(self) -> int:
        """Stages the search is cut into (its plan's)."""
        return self._key.num_stages

    def outlook(self, stage: int, elapsed_s: float) -> StageOutlook:
        """What searches of this plan taught about the rest of this one after ``stage`` (0: its
        start), ``elapsed_s`` into it (:meth:`StageStatistics.outlook`)."""
        return self._stats.outlook(self._key, stage, elapsed_s)
