"""Calibration of bench.pipeline's sweep: one search per probe share, one prefill per prompt size.

The sweep sets the search-to-prefill ratio r by two knobs, the share of the IVF lists probed (or
HNSW's efSearch) and the prompt's passages k. Timing each knob alone predicts r for every pair,
and the pair nearest each target ratio becomes a point; r itself is then measured at the point
(:mod:`bench.pipeline.analysis`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.e2e.runner import one_search_ms, search_times_ms, set_search_ratio, ttft_of
from specrag.paths import DataLayout
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import IndexConfig
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import StagedSearcher
from specrag.retrieval.synthetic import PADDING_VERSION
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import Assets, ensure_index

# 0.05: the low-r point, where search hides little of the prefill and a speculation rarely pays.
TARGET_RATIOS = (0.05, 0.25, 0.5, 1.0, 2.0)
# --quick's: the points the figures quote (low r, and r near 1, where the loaded run also goes);
# the curve between and beyond them is the full run's. Each point's queries stay as many.
QUICK_TARGET_RATIOS = (0.05, 1.0)
# Shares of the probe list the calibration times; 3/4 fills the gap where r crosses 1 for one passage.
PROBE_SHARES = (1 / 256, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)
PROMPT_SIZES = (1, 2, 4, 8)
# Among settings about as close to a target ratio, prefer prompts of this many passages.
PREFERRED_K = 4
EF_SEARCH_RANGE = (64, 16384)
CALIBRATION_QUERIES = 4


@dataclass(frozen=True)
class Point:
    """One point of the sweep: what sets its ratio and the ratio the calibration predicts."""

    kind: str
    knob: float  # IVF: share of the lists probed; HNSW: efSearch
    k: int
    predicted_ratio: float
    search_ms: float
    prefill_ms: float


def calibration_queries(
    passages: Sequence[Passage], index: VectorIndex, seed: int
) -> tuple[list[str], np.ndarray]:
    """The calibration's questions (the openings of random passages) and their query vectors."""
    rng = np.random.default_rng(seed + 99)
    picks = rng.integers(0, len(passages), CALIBRATION_QUERIES)
    queries = [passages[int(i)].text[:120] for i in picks]
    return queries, np.stack([index.embed_query(query) for query in queries])


async def prefill_ms_by_k(
    engine: Engine, index: VectorIndex, builder: PromptBuilder, queries: Sequence[str], vectors: np.ndarray
) -> dict[int, float]:
    """The median TTFT of a k-passage prompt with only the system prompt cached, per k."""
    result = {}
    for k in PROMPT_SIZES:
        timings = []
        for query, vector in zip(queries, vectors, strict=True):
            _, rows = index.search(vector[None, :], k, batch=True)
            passages = sorted({int(r) for r in index.passage_index_of(rows[0]) if r >= 0})
            await engine.reset_prefix_cache()
            await ttft_of(engine, builder.system_layout_tokens())
            timings.append(await ttft_of(engine, builder.build(passages, query).token_ids) * 1000)
        result[k] = statistics.median(timings)
    return result


def nearest_point(
    kind: str, search_ms: dict[float, float], prefill_ms: dict[int, float], target: float
) -> Point:
    """The (knob, k) whose predicted S / P is nearest ``target`` (log scale), preferring k near 4."""

    def distance(knob: float, k: int) -> float:
        off = abs(math.log(search_ms[knob] / prefill_ms[k] / target))
        return off + 0.05 * abs(math.log2(k / PREFERRED_K))

    knob, k = min(((knob, k) for knob in search_ms for k in prefill_ms), key=lambda pair: distance(*pair))
    return Point(kind, knob, k, search_ms[knob] / prefill_ms[k], search_ms[knob], prefill_ms[k])


async def search_ms_by_share(index: VectorIndex, vectors: np.ndarray) -> dict[float, float]:
    """One search's median time per probe share of ``index``'s lists.

    A search of every list first, untimed, brings the whole index in for the timed ones.
    """
    set_search_ratio(index, 1.0)
    await search_times_ms(index, vectors, PREFERRED_K)
    search_ms = {}
    for share in PROBE_SHARES:
        set_search_ratio(index, share)
        search_ms[share] = await one_search_ms(index, vectors, PREFERRED_K)
    settings = index.searcher.settings
    lists = settings.get("codes", settings["kind"])  # pgvector's IVFFlat lists have no codes
    print(
        f"one search (ms) by probe share, {lists} lists:",
        {f"{s:.3g}": round(v, 1) for s, v in search_ms.items()},
    )
    return search_ms


async def calibrate(
    engine: Engine, builder: PromptBuilder, index: VectorIndex, queries: Sequence[str], vectors: np.ndarray
) -> tuple[dict[float, float], dict[int, float]]:
    """One search per probe share and one prefill per prompt size, to choose the sweep's points."""
    search_ms = await search_ms_by_share(index, vectors)
    prefill_ms = await prefill_ms_by_k(engine, index, builder, queries, vectors)
    print("prefill (ms) by k, system prompt cached:", {k: round(v, 1) for k, v in prefill_ms.items()})
    return search_ms, prefill_ms


def sweep_points(
    search_ms: dict[float, float], prefill_ms: dict[int, float], targets: Sequence[float] = TARGET_RATIOS
) -> list[Point]:
    """The point nearest each target ratio; targets the index cannot reach share a point (run once)."""
    points: dict[tuple[float, int], Point] = {}
    for target in targets:
        point = nearest_point("ivf", search_ms, prefill_ms, target)
        points.setdefault((point.knob, point.k), point)
    return list(points.values())


async def hnsw_index(layout: DataLayout, assets: Assets, size: int, runner: SearchRunner) -> VectorIndex:
    """A padded HNSW index (built once); imported only now that the engine runs (numba, see index_store)."""
    directory = layout.root / f"index-scaled-hnsw-{size}-p{PADDING_VERSION}"
    print(f"padded HNSW index ({size:,} vectors) in {directory}: built if missing or stale", flush=True)
    index = ensure_index(layout, assets.passages, IndexConfig(kind="hnsw", pad_to=size), directory)
    index.use_runner(runner)
    return index


def on_searcher(
    index: VectorIndex,
    searcher: StagedSearcher,
    synthetic_sources: np.ndarray | None = None,
    default_stages: int | None = None,
) -> VectorIndex:
    """``index``'s passages, embedder, runner and BM25 channel over another dense ``searcher``
    (its synthetic rows ``synthetic_sources``, else ``index``'s): only the dense search changes."""
    return VectorIndex(
        searcher,
        index.passage_ids,
        index.synthetic_sources if synthetic_sources is None else synthetic_sources,
        index.embedder,
        index.runner,
        index.lexical,
        index.fusion,
        default_stages,
    )


def with_ef_search(index: VectorIndex, ef_search: int) -> VectorIndex:
    """The same graph searched at ``ef_search`` (its stage sizes recalibrated), hybrid when the
    index is, like the IVF points: only the dense channel's search changes."""
    searcher: Any = index.searcher
    return on_searcher(index, type(searcher)(searcher.owner, ef_search))


async def hnsw_point(
    index: VectorIndex, vectors: np.ndarray, prefill_ms: dict[int, float]
) -> tuple[VectorIndex, Point]:
    """Double efSearch until one search takes about a prefill (r near 1) or the range ends."""
    ef = EF_SEARCH_RANGE[0]
    search_ms: dict[float, float] = {}
    tuned: dict[float, VectorIndex] = {}
    while ef <= min(EF_SEARCH_RANGE[1], index.searcher.ntotal):
        tuned[ef] = with_ef_search(index, ef)
        search_ms[ef] = await one_search_ms(tuned[ef], vectors, PREFERRED_K)
        if search_ms[ef] >= min(prefill_ms.values()):
            break
        ef *= 2
    point = nearest_point("hnsw", search_ms, prefill_ms, 1.0)
    return tuned[point.knob], point
