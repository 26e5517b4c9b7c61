"""A batch of questions known together, answered in the order that shares the most prompt prefix.

Online, each query orders its documents against what the engine already caches; a batch can do
better because every context is known before the first prompt runs. The batch is retrieved first
(every question embedded, one batched search), planned with :func:`specrag.cache.batch.plan_batch`
(ContextPilot: cluster the contexts by shared documents, order each along the shared-prefix tree,
schedule depth-first so that consecutive prompts share the longest prefixes), then run through the
controller in the plan's schedule, each query with the plan's document order (its retrieval order
when its mode does no ordering). Every answer keeps its own timeline.

A query starts once the one before it in the schedule has its first token: its prompt's blocks are
then in the engine's prefix cache (an engine reuses only blocks computed before it schedules a
request), so the next prompt reuses them, while the answers decode together. The batch fails as a
whole: the first failure aborts the queries still running and is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specrag.cache.batch import plan_batch
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, Planned
from specrag.errors import EngineError, InvalidInputError
from specrag.retrieval.backends.shards.merge import ShardAnswers
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["BatchAnswers", "BatchPlanReport", "Stream", "retrieve", "run_batch", "schedule"]

Stream = Callable[[CheckedRequest], AsyncGenerator[AnswerDelta | AnswerDone, None]]
"""Runs one checked query (the controller's ``stream``)."""


@dataclass(frozen=True)
class BatchPlanReport:
    """What the plan decided and what it cost: ``order`` is the schedule (indices of the questions
    as asked), ``documents`` each question's passage ids in prompt order."""

    order: tuple[int, ...]
    documents: tuple[tuple[str, ...], ...]
    retrieval_s: float
    planning_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "order": list(self.order),
            "documents": [list(ids) for ids in self.documents],
            "retrieval_ms": round(self.retrieval_s * 1000, 3),
            "planning_ms": round(self.planning_s * 1000, 3),
        }


@dataclass(frozen=True)
class BatchAnswers:
    """Every answer in the order the questions were asked, and the plan they ran by."""

    answers: tuple[AnswerDone, ...]
    plan: BatchPlanReport


async def retrieve(
    index: VectorIndex, checked: Sequence[CheckedRequest], shard_answers: ShardAnswers | None = None
) -> list[tuple[int, ...]]:
    """Each question's corpus rows in retrieval rank: the staged search's final result, as a query
    of mode ``serial`` would get it (hybrid where the index has a lexical channel); with
    ``shard_answers``, of the shards of a sharded index that answered."""
    questions = [request.request.question for request in checked]
    loop = asyncio.get_running_loop()
    vectors = await loop.run_in_executor(None, lambda: np.stack([index.embed_query(q) for q in questions]))
    k = max(request.k for request in checked)
    final = None
    plan = index.stage_plan(1)
    search = index.search_staged(
        vectors, k, plan, query_text=questions, batch=True, shard_answers=shard_answers
    )
    async with contextlib.aclosing(search) as stages:
        async for stage in stages:
            final = stage
    if final is None:
        raise EngineError("the batch's search returned no result")
    return [
        index.ranked_rows(final.for_query(number).ids)[: request.k] for number, request in enumerate(checked)
    ]


def schedule(
    checked: Sequence[CheckedRequest],
    rows: Sequence[tuple[int, ...]],
    shard_answers: ShardAnswers | None = None,
) -> tuple[tuple[int, ...], list[CheckedRequest]]:
    """The schedule (indices of ``checked``) and the queries in it, each with its planned documents
    (and the shards that answered their search, ``shard_answers``)."""
    made = plan_batch(rows)
    queries = []
    for position, number in enumerate(made.order):
        ordered = checked[number].mode.ordering
        order = tuple(int(row) for row in made.contexts[number]) if ordered else rows[number]
        planned = Planned(rows[number], order, position, shard_answers)
        queries.append(replace(checked[number], planned=planned))
    return made.order, queries


async def run_batch(index: VectorIndex, checked: Sequence[CheckedRequest], stream: Stream) -> BatchAnswers:
    """Retrieve, plan and answer ``checked`` (see the module doc)."""
    if not checked:
        raise InvalidInputError("a batch needs at least one question")
    started = time.perf_counter()
    # The questions of a batch share its options: one accepting a partial top-k, all do.
    shards = ShardAnswers() if any(query.request.allow_partial for query in checked) else None
    rows = await retrieve(index, checked, shards)
    retrieved = time.perf_counter()
    order, queries = schedule(checked, rows, shards)
    planned = time.perf_counter()
    answers: list[AnswerDone | None] = [None] * len(checked)
    documents: list[tuple[str, ...]] = [()] * len(checked)
    for number, query, answer in zip(order, queries, await _answer_in_order(queries, stream), strict=True):
        answers[number] = answer
        assert query.planned is not None
        documents[number] = tuple(index.passage_ids[row] for row in query.planned.order)
    report = BatchPlanReport(order, tuple(documents), retrieved - started, planned - retrieved)
    return BatchAnswers(tuple(answer for answer in answers if answer is not None), report)


async def _answer(query: CheckedRequest, stream: Stream, started: asyncio.Event) -> AnswerDone:
    """The query's whole answer; ``started`` is set at its first event (its first token)."""
    try:
        async with contextlib.aclosing(stream(query)) as events:
            async for event in events:
                started.set()
                if isinstance(event, AnswerDone):
                    return event
    finally:
        started.set()
    raise EngineError("the answer stream ended without a result")


async def _answer_in_order(queries: Sequence[CheckedRequest], stream: Stream) -> list[AnswerDone]:
    """Every query's answer; each starts once the one before it has its first token (module doc).

    The first failure is raised at once and every query still running is cancelled, which aborts
    its engine requests.
    """
    tasks: list[asyncio.Task[AnswerDone]] = []
    try:
        for query in queries:
            started = asyncio.Event()
            tasks.append(asyncio.create_task(_answer(query, stream, started)))
            first = asyncio.create_task(started.wait())
            try:
                while not first.done():
                    running = {task for task in tasks if not task.done()}
                    await asyncio.wait({first, *running}, return_when=asyncio.FIRST_COMPLETED)
                    for task in tasks:
                        if task.done():
                            task.result()  # raises the first failure
            finally:
                first.cancel()
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
