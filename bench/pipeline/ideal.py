"""Two measured bounds: each final prompt prefilled from its search's start, and from the first
stage whose running top-k holds it.

bench.pipeline's bound, ``embed + max(search, prefill)``, takes the search and the prefill as
serial measured them, each alone. Overlapped they run at once, on two cores that share the
memory bus and the last-level cache, and each may be slower beside the other
(``bench.pipeline.contention``). No schedule can beat that, so every point also runs ``ideal``: a
speculation that is never wrong. The same queries, one at a time, from an emptied prefix cache as
each configuration starts, submit serial's own final prompt (so the same tokens are cached before
each) at the instant their search starts; the search is serial's one-shot (hybrid) search on the
same search thread. A query's ideal TTFT is its serial embedding time plus the later of the
search's end and the first token, from that instant. ``overlap_fraction_of_ideal`` is then a
configuration's share of the gain this machine can give: ``(serial − config) / (serial − ideal)``.

The ideal knows the answer before any stage has run. A speculation can only submit a running
top-k, so it can submit the final prompt no earlier than the end of the first stage whose top-k
holds the final passages; it submits there only if it never guesses wrong. ``earliest`` measures
that: the staged search of a plan runs as the controller runs it, and serial's final prompt is
submitted the moment the first stage holding the final passages reaches the event loop. No
policy that speculates from that plan's stages does better, whatever it knows of the odds; the
gap between ``earliest`` and ``ideal`` is what the search itself does not reveal in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from bench.e2e.runner import ttft_of
from bench.e2e.workload import TraceQuery
from specrag.pipeline.engine import Engine, now
from specrag.retrieval.stages import StagePlan
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["earliest_records", "ideal_records"]


async def ideal_records(
    engine: Engine,
    index: VectorIndex,
    trace: Sequence[TraceQuery],
    first: int,
    k: int,
    serial: dict[int, dict[str, Any]],
    prompts: dict[int, tuple[int, ...]],
) -> list[dict[str, Any]]:
    """One record per query of ``trace`` (numbered from ``first``) that serial answered: ``ttft_ms``
    as above, ``search_ms`` and ``prefill_beside_search_ms`` (submission to first token)."""
    await engine.reset_prefix_cache()
    records = []
    for i, query in _answered(trace, first, serial, prompts):
        vector = index.embed_query(query.query)
        started = now()
        search = asyncio.ensure_future(_search_end(index, vector, k, query.query))
        prefill_s = await ttft_of(engine, prompts[i])  # its clock starts as the search's task is made
        search_s = await search - started
        records.append(
            {
                "i": i,
                "ttft_ms": serial[i]["embed_ms"] + max(search_s, prefill_s) * 1000,
                "search_ms": search_s * 1000,
                "prefill_beside_search_ms": prefill_s * 1000,
            }
        )
    return records


async def earliest_records(
    engine: Engine,
    index: VectorIndex,
    trace: Sequence[TraceQuery],
    first: int,
    k: int,
    serial: dict[int, dict[str, Any]],
    prompts: dict[int, tuple[int, ...]],
    plan: StagePlan,
) -> list[dict[str, Any]]:
    """As :func:`ideal_records`, with serial's prompt submitted as the first stage of ``plan``
    whose top-k holds the final passages ends; ``stage`` is that stage (from 1), ``submitted_ms``
    its time from the search's start, and ``non_overlapped_retrieval_ms`` (from the embedding's
    start, as a timeline counts it) the search before it.

    Its searches leave the index's stage statistics as they were: the configurations that
    run after it learn from their own searches only.
    """
    answered = list(_answered(trace, first, serial, prompts))
    vectors = {i: index.embed_query(query.query) for i, query in answered}
    # What to wait for, searched untimed before any query is timed: searched just before its own
    # timed search, a query would find its index lists warm, as no configuration's search does.
    finals = {
        i: set(index.ranked_rows(index.search(vectors[i], k, query_text=query.query)[1])[:k])
        for i, query in answered
    }
    await engine.reset_prefix_cache()
    records = []
    for i, query in answered:
        vector, final = vectors[i], finals[i]
        started = now()
        first_token: asyncio.Future[float] | None = None
        stage_number, submitted = 0, 0.0
        async for stage in index.search_staged(vector, k, plan, query_text=query.query, learn=False):
            if first_token is None and set(index.ranked_rows(stage.ids)[:k]) == final:
                submitted = now()
                stage_number = stage.stage
                first_token = asyncio.ensure_future(ttft_of(engine, prompts[i], submitted))
        search_s = now() - started
        assert first_token is not None, "a staged search's last stage holds the one-shot result"
        answer_s = submitted - started + await first_token
        embed_ms = serial[i]["embed_ms"]
        records.append(
            {
                "i": i,
                "ttft_ms": embed_ms + max(search_s, answer_s) * 1000,
                "embed_ms": embed_ms,
                "search_ms": search_s * 1000,
                "stage": stage_number,
                "submitted_ms": (submitted - started) * 1000,
                "non_overlapped_retrieval_ms": embed_ms + min(submitted - started, search_s) * 1000,
                "prefill_beside_search_ms": (answer_s - (submitted - started)) * 1000,
            }
        )
    return records


def _answered(
    trace: Sequence[TraceQuery],
    first: int,
    serial: dict[int, dict[str, Any]],
    prompts: dict[int, tuple[int, ...]],
) -> Iterator[tuple[int, TraceQuery]]:
    """The queries of ``trace`` (numbered from ``first``) that serial answered, with their numbers."""
    for number, query in enumerate(trace):
        if first + number in prompts and first + number in serial:
            yield first + number, query


async def _search_end(index: VectorIndex, vector: Any, k: int, text: str) -> float:
    """When serial's search (one stage, on the index's search thread) of this query ends."""
    async for _ in index.search_staged(vector, k, index.stage_plan(1), query_text=text, learn=False):
        pass
    return now()
