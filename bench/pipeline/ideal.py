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
gap between ``earliest`` and ``ideal`` is what the search itself does not reveal in time. Both are
one measurement, :func:`bound_records`, that differs only in when the prompt goes in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from bench.e2e.runner import ttft_of
from bench.e2e.workload import TraceQuery
from specrag.pipeline.engines.protocol import Engine, now
from specrag.retrieval.search.stages import StagePlan
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["bound_records"]


async def bound_records(
    engine: Engine,
    index: VectorIndex,
    trace: Sequence[TraceQuery],
    first: int,
    k: int,
    serial: dict[int, dict[str, Any]],
    prompts: dict[int, tuple[int, ...]],
    plan: StagePlan | None,
) -> list[dict[str, Any]]:
    """One record per query of ``trace`` (numbered from ``first``) that serial answered, its
    ``prompts`` entry submitted beside the query's search: with ``plan`` None (``ideal``) as
    serial's one-shot search starts, else (``earliest``) as the first stage of ``plan`` whose top-k
    holds the final passages ends. ``ttft_ms`` as above; ``stage`` is the stage it went in after
    (from 1; 0: the search's start), ``submitted_ms`` its time from the search's start,
    ``prefill_beside_search_ms`` submission to first token, and ``non_overlapped_retrieval_ms``
    (from the embedding's start, as a timeline counts it) the search before the submission.

    Its searches leave the index's stage statistics as they were: the configurations that
    run after it learn from their own searches only.
    """
    numbered = ((first + n, query) for n, query in enumerate(trace))
    answered = [(i, query) for i, query in numbered if i in prompts and i in serial]
    vectors = {i: index.embed_query(query.query) for i, query in answered}
    # What ``earliest`` waits for, searched untimed before any query is timed: searched just before
    # its own timed search, a query would find its index lists warm, as no configuration's does.
    finals = {
        i: set(index.ranked_rows(index.search(vectors[i], k, query_text=query.query)[1])[:k])
        for i, query in answered
        if plan is not None
    }
    await engine.reset_prefix_cache()
    records = []
    for i, query in answered:
        started = now()
        first_token: asyncio.Future[float] | None = None
        if plan is None:  # ideal: the prompt goes in as the search starts
            first_token = asyncio.ensure_future(ttft_of(engine, prompts[i], started))
        stage_number, submitted = 0, started
        search = index.search_staged(
            vectors[i], k, plan or index.stage_plan(1), query_text=query.query, learn=False
        )
        async for stage in search:
            if first_token is None and set(index.ranked_rows(stage.ids)[:k]) == finals[i]:
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
