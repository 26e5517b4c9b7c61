"""The overlap bound as this machine allows it: each final prompt prefilled from its search's start.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from bench.e2e.runner import ttft_of
from bench.e2e.workload import TraceQuery
from specrag.pipeline.engine import Engine, now
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["ideal_records"]


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
    for number, query in enumerate(trace):
        i = first + number
        if i not in prompts or i not in serial:
            continue
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


async def _search_end(index: VectorIndex, vector: Any, k: int, text: str) -> float:
    """When serial's search (one stage, on the index's search thread) of this query ends."""
    async for _ in index.search_staged(vector, k, index.stage_plan(1), query_text=text):
        pass
    return now()
