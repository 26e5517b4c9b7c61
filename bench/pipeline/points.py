"""bench.pipeline's measured points: every configuration replayed on one point's trace.

An idle point replays one query at a time and ends each half of its trace with the measured bounds
(:mod:`bench.pipeline.ideal`); the loaded point replays Poisson arrivals; the HNSW and flat-IVF
points are idle points on other indexes. Each configuration runs from an emptied prefix cache and
a fresh controller on the one engine the run shares (:class:`Stack`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import pin_apart
from bench.e2e.report import answered
from bench.e2e.runner import Configuration, RunResult, replay, search_times_ms, set_search_ratio, ttft_of
from bench.e2e.workload import TraceQuery, generate
from bench.pipeline.analysis import (
    BOUNDS,
    EARLIEST,
    EARLIEST_FINE,
    IDEAL,
    loaded_summary,
    point_summary,
    saturation_rps,
)
from bench.pipeline.calibration import (
    PREFERRED_K,
    PROMPT_SIZES,
    Point,
    hnsw_index,
    hnsw_point,
    nearest_point,
    search_ms_by_share,
)
from bench.pipeline.ideal import bound_records
from bench.pipeline.report import print_loaded, print_point
from specrag.controller.config import ControllerConfig
from specrag.paths import DataLayout
from specrag.pipeline.engines.config import KVEventSource, parse_cpus
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import DEFAULT_SCHEDULE, Schedule
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_controller, open_engine, prompt_builder
from specrag.service.run.assets import Assets

# An idle trace spaces arrivals this many times one query's expected search + prefill apart.
IDLE_GAP_FACTOR = 2.0
# earliest-fine's plan: equal stages of about a thirty-second of the search each.
FINE_STAGES = 32


@dataclass
class Stack:
    """What every configuration of one run shares."""

    engine: Engine
    kv_events: KVEventSource | None
    builder: PromptBuilder
    base: ControllerConfig
    max_tokens: int


@contextlib.asynccontextmanager
async def open_stack(args: argparse.Namespace, assets: Assets, run_dir: Path) -> AsyncIterator[Stack]:
    """The run's one engine, its processes pinned to ``--engine-cpus`` and this process to
    ``--search-cpus``, warmed up once (not measured), with the controller settings every
    configuration starts from; the engine's files go to ``run_dir``."""
    options = ServiceOptions(eager=args.eager, engine_cpus=args.engine_cpus)
    async with open_engine(assets.model_dir, options, run_dir) as (engine, kv_events):
        pinned = pin_apart(
            parse_cpus(args.engine_cpus, "--engine-cpus"), parse_cpus(args.search_cpus, "--search-cpus")
        )
        print(f"pinned to core(s) {args.engine_cpus}: {', '.join(pinned)}", flush=True)
        builder = prompt_builder(assets, engine)
        await ttft_of(engine, builder.system_layout_tokens())  # one-off engine warm-up, not measured
        base = ControllerConfig(
            k_default=PREFERRED_K,
            k_max=max(PROMPT_SIZES),
            max_tokens_default=args.max_tokens,
            num_stages=args.stages,
        )
        yield Stack(engine, kv_events, builder, base, args.max_tokens)


def configurations(search_share: float) -> list[Configuration]:
    """serial, speculation on equal and on default stages, and all (default stages), each speculation
    priced by the speculation policy (``auto``, the default); and all with every speculation
    launched unpriced (``all-always``, the behaviour before the policy)."""
    return [
        Configuration("serial", "serial", "pipeline", search_share),
        Configuration("spec-equal", "speculation", "pipeline", search_share, {"stage_schedule": "equal"}),
        Configuration(
            f"spec-{DEFAULT_SCHEDULE}",
            "speculation",
            "pipeline",
            search_share,
            {"stage_schedule": DEFAULT_SCHEDULE},
        ),
        Configuration("all", "all", "pipeline", search_share, {"stage_schedule": DEFAULT_SCHEDULE}),
        Configuration(
            "all-always",
            "all",
            "pipeline",
            search_share,
            {"stage_schedule": DEFAULT_SCHEDULE, "speculation": "always"},
        ),
    ]


def halves(trace: Sequence[TraceQuery]) -> list[tuple[int, list[TraceQuery]]]:
    """The trace's two halves, each with the index of its first query and arrivals from 0."""
    middle = len(trace) // 2
    return [
        (start, [replace(query, t=query.t - part[0].t) for query in part])
        for start, part in ((0, list(trace[:middle])), (middle, list(trace[middle:])))
        if part
    ]


def idle_trace(
    passages: Sequence[Passage], point: Point, n: int, max_tokens: int, seed: int
) -> list[TraceQuery]:
    """Near-regular arrivals far enough apart that each query runs alone."""
    gap_s = IDLE_GAP_FACTOR * (point.search_ms + point.prefill_ms) / 1000 + 0.05 * max_tokens + 0.2
    return generate(passages, "zipf", n, 1 / gap_s, cv=0.05, seed=seed)


async def run_all(
    stack: Stack, index: VectorIndex, point: Point, trace: Sequence[TraceQuery], ideal: bool = True
) -> dict[str, RunResult]:
    """Every configuration on ``trace``, each from an emptied prefix cache and a fresh controller.

    The trace's searches run once before, untimed: the first configuration to touch a query's
    probe lists otherwise pays for bringing them in (serial, the first, took 2-3x as long as
    the same searches later at some points on the 2-core VM, which set overlap_fraction above 1).

    The configurations run in one order on the trace's first half and in the reverse order on
    its second (ABCD DCBA), so that a machine that grows faster or slower during a point weighs
    on every configuration alike, serial (whose timelines set the bound) included: run one after
    the other on the whole trace, the first configuration and the last were a minute apart.

    With ``ideal`` (idle points: queries one at a time), each half ends with the measured bounds
    (:func:`~bench.pipeline.ideal.bound_records`) on serial's prompts of that half: ``ideal``, and
    ``earliest`` on ``all``'s plan and ``earliest-fine`` on a fine one.
    """
    nprobe = set_search_ratio(index, point.knob) if point.kind == "ivf" else 0
    await search_times_ms(index, np.stack([index.embed_query(query.query) for query in trace]), point.k)
    order = configurations(point.knob if point.kind == "ivf" else math.nan)
    results = {c.name: RunResult(c, [], 0.0, nprobe) for c in order}
    for number, (first, half) in enumerate(halves(trace)):
        for configuration in order if number == 0 else order[::-1]:
            config = replace(stack.base, mode=configuration.mode, **configuration.overrides)
            opened = open_controller(
                stack.engine, stack.kv_events, index, stack.builder, config, empty_cache=True
            )
            async with opened as (controller, _mirror):
                records, prompts, wall = await replay(
                    controller, half, point.k, stack.max_tokens, configuration.mode
                )
            result = results[configuration.name]
            result.records.extend({**record, "i": record["i"] + first} for record in records)
            result.prompts.update({i + first: prompt for i, prompt in prompts.items()})
            result.wall_s += wall
        if ideal:
            await run_bounds(stack, index, point, half, first, results)
    return results


async def run_bounds(
    stack: Stack,
    index: VectorIndex,
    point: Point,
    half: Sequence[TraceQuery],
    first: int,
    results: dict[str, RunResult],
) -> None:
    """The measured bounds (:data:`BOUNDS`) on serial's answered queries of ``half``, into ``results``."""
    serial = results["serial"]
    answers = {r["i"]: r for r in answered(serial.records)}
    plans = {
        IDEAL: None,
        EARLIEST: index.stage_plan(stack.base.num_stages, DEFAULT_SCHEDULE),
        EARLIEST_FINE: index.stage_plan(FINE_STAGES, Schedule.EQUAL),
    }
    for name in BOUNDS:
        started = time.perf_counter()
        found = await bound_records(
            stack.engine, index, half, first, point.k, answers, serial.prompts, plans[name]
        )
        bound = results.setdefault(
            name, RunResult(Configuration(name, name, "pipeline", math.nan), [], 0.0, serial.nprobe)
        )
        bound.records.extend(found)
        bound.wall_s += time.perf_counter() - started


async def idle_sweep(
    stack: Stack,
    index: VectorIndex,
    passages: Sequence[Passage],
    points: Sequence[Point],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], list[dict[str, RunResult]]]:
    summaries, runs = [], []
    for number, point in enumerate(points):
        summary, results = await idle_point(stack, index, point, passages, args, args.seed + number, "idle")
        summaries.append(summary)
        runs.append(results)
    return summaries, runs


async def idle_point(
    stack: Stack,
    index: VectorIndex,
    point: Point,
    passages: Sequence[Passage],
    args: argparse.Namespace,
    seed: int,
    label: str,
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """One idle point on ``index``, whatever backend searches it (a local IVF or HNSW index, a
    pgvector table): its trace drawn with ``seed``, every configuration and bound, its summary
    (printed under ``label``)."""
    trace = idle_trace(passages, point, args.idle_queries, args.max_tokens, seed)
    runs = await run_all(stack, index, point, trace)
    summary = point_summary(point, runs, index)
    print_point(summary, label)
    return summary, runs


async def ivf_point_near_one(
    stack: Stack,
    index: VectorIndex,
    passages: Sequence[Passage],
    vectors: np.ndarray,
    prefill_ms: dict[int, float],
    args: argparse.Namespace,
    seed: int,
    label: str,
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """The idle point nearest r = 1 on an index searched by probe share (the flat IVF index, a
    pgvector table): one search per probe share sets it, then :func:`idle_point`."""
    point = nearest_point("ivf", await search_ms_by_share(index, vectors), prefill_ms, 1.0)
    return await idle_point(stack, index, point, passages, args, seed, label)


async def loaded_run(
    stack: Stack,
    index: VectorIndex,
    passages: Sequence[Passage],
    point: Point,
    idle_serial: Sequence[dict[str, Any]],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """Poisson arrivals at ``args.utilization`` of the saturation rate the idle serial run shows."""
    saturation = saturation_rps(idle_serial)
    target_rps = args.utilization * saturation
    drawn = generate(passages, "zipf", args.loaded_queries, target_rps, seed=args.seed + 50)
    # A short Poisson trace's own rate strays far from the target (tens of percent at 20 arrivals):
    # stretch its gaps so that it offers exactly the target rate, keeping their shape.
    stretch = (len(drawn) - 1) / drawn[-1].t / target_rps
    trace = [replace(query, t=query.t * stretch) for query in drawn]
    offered_rps = (len(trace) - 1) / trace[-1].t
    results = await run_all(stack, index, point, trace, ideal=False)  # arrivals overlap: no ideal
    summary = loaded_summary(point, results, index, offered_rps / saturation, saturation)
    print_loaded(summary)
    return summary, results


async def graph_point(
    stack: Stack,
    layout: DataLayout,
    assets: Assets,
    runner: SearchRunner,
    vectors: np.ndarray,
    prefill_ms: dict[int, float],
    args: argparse.Namespace,
) -> tuple[dict[str, Any] | None, dict[str, RunResult]]:
    """The idle point nearest r = 1 on the padded HNSW index (none with ``--hnsw-size 0``)."""
    if not args.hnsw_size:
        return None, {}
    graph = await hnsw_index(layout, assets, args.hnsw_size, runner)
    hnsw, hnsw_at = await hnsw_point(graph, vectors, prefill_ms)
    return await idle_point(stack, hnsw, hnsw_at, assets.passages, args, args.seed + 70, "idle")


async def flat_point(
    stack: Stack,
    flat: VectorIndex | None,
    passages: Sequence[Passage],
    vectors: np.ndarray,
    prefill_ms: dict[int, float],
    args: argparse.Namespace,
) -> tuple[dict[str, Any] | None, dict[str, RunResult]]:
    """The idle point nearest r = 1 on the flat IVF index, to show what its memory traffic costs.

    A flat scan reads four times the memory of an SQ8 one; beside a prefill on the other core
    it slows both (bench.pipeline.contention), which a sweep on SQ8 lists does not show.
    """
    if flat is None:
        return None, {}
    return await ivf_point_near_one(
        stack, flat, passages, vectors, prefill_ms, args, args.seed + 80, "idle, flat IVF"
    )
