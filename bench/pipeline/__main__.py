"""Where speculative pipelining pays: TTFT against the search-to-prefill ratio r = S / P.

Overlapping the search with the answer's prefill can at best hide the shorter of the two: per
query the **overlap bound** is ``embed + max(search, prefill)``, taken from the serial
configuration's own timeline (prefill = serial TTFT - embed - search). Each configuration's share
of the possible gain is ``overlap_fraction = (serial - config) / (serial - bound)`` over the
means, with a 95 % bootstrap interval over the queries, and ``non_overlapped_over_search`` is its
mean non-overlapped search time over serial's mean search time.

The sweep sets r by the IVF probe share (nprobe) of a padded index and by the prompt size k, chosen
from a calibration of one search per probe share and one prefill per k; r is then *measured* from
the serial run's timelines. At each point, one query at a time (idle), it runs ``serial``,
``speculation`` with equal stages, ``speculation`` with the default schedule and ``all`` (default
schedule); at the point nearest r = 1 the same four also run loaded (Poisson arrivals at
``--utilization`` of the saturation rate measured from the idle serial run). Two more idle points
near r = 1: an HNSW index (efSearch sets its search time), and a flat IVF index. Every idle point
also runs ``ideal`` (:mod:`bench.pipeline.ideal`): serial's final prompt submitted at the search's
start, the bound as this machine allows it, and each configuration's ``overlap_fraction_of_ideal``;
and ``earliest``: serial's final prompt submitted as the first stage of ``all``'s plan holding the
final passages ends, the best any speculation from those stages can do (``earliest-fine``: the
same on a plan of many equal stages), and ``all``'s share of its gain.

The sweep's index has SQ8 lists (``--kind``, one byte a dimension) by default. Search and prefill
share the machine's memory: a flat scan streams four times the bytes and slowed the prefill on
the other core by 17-41 % on the 2-core VM, an SQ8 scan by 2 % (``bench.pipeline.contention``'s
``prefill_beside_ivf`` and ``prefill_beside_ivf-sq8``, two runs), so on flat lists overlap falls
short of the bound for a reason no schedule can remove. The flat point shows it in the same run.

Fair set-up as in bench.e2e: every thread of the engine's processes is pinned to
``--engine-cpus``, the benchmark's own process (event loop and search thread) to
``--search-cpus``, one engine and one trace per figure, a
fresh controller and an emptied prefix cache for every configuration (the first query's cached
prompt tokens are recorded to confirm it).

Rerun: ``.venv/bin/python -m bench.pipeline --quick`` (under 12 minutes on two cores once the
padded indexes exist; building them the first time takes minutes more) or without ``--quick``
(more queries, a 12M-vector index). The index sizes are what puts search beside prefill: on the
2-core machine one thread scans the 8M-vector SQ8 index's lists in about as long as the default
model prefills one passage (r near 1), and the 12M one reaches r near 2. Writes
bench/out/pipeline.json (every per-request timeline) and pipeline.png; the last line printed is
a JSON summary.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    add_model_option,
    bootstrap_ratio_ci,
    machine,
    pin_apart,
    plot_path,
    print_summary,
    run_measurement,
    write_json,
)
from bench.e2e.report import summarize
from bench.e2e.runner import (
    Configuration,
    RunResult,
    one_search_ms,
    replay,
    search_times_ms,
    set_search_ratio,
    ttft_of,
)
from bench.e2e.workload import TraceQuery, generate
from bench.indexes import scaled_index
from bench.pipeline.ideal import bound_records
from specrag.controller.config import ControllerConfig
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.config import KVEventSource, parse_cpus
from specrag.pipeline.engine import Engine
from specrag.pipeline.prompt import PromptBuilder
from specrag.pipeline.random_model import RANDOM_MODEL_NAME
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import IndexConfig
from specrag.retrieval.search_runner import SearchRunner
from specrag.retrieval.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES, Schedule
from specrag.retrieval.synthetic import PADDING_VERSION
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.assembly import ServiceOptions, open_controller, open_engine, prompt_builder
from specrag.service.assets import Assets, ensure_assets, ensure_index

# 0.05: the low-r point, where search hides little of the prefill and a speculation rarely pays.
TARGET_RATIOS = (0.05, 0.25, 0.5, 1.0, 2.0)
# IVF kinds (index_store.KINDS) the sweep can run on.
SWEEP_KINDS = ("ivf-sq8", "ivf", "ivf-pq")
# Shares of the probe list the calibration times; 3/4 fills the gap where r crosses 1 for one passage.
PROBE_SHARES = (1 / 256, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)
PROMPT_SIZES = (1, 2, 4, 8)
# Among settings about as close to a target ratio, prefer prompts of this many passages.
PREFERRED_K = 4
EF_SEARCH_RANGE = (64, 16384)
CALIBRATION_QUERIES = 4
# An idle trace spaces arrivals this many times one query's expected search + prefill apart.
IDLE_GAP_FACTOR = 2.0
# The measured bounds' runs (bench.pipeline.ideal) among a point's results: the final prompt from
# the search's start, and from the end of the first stage holding it on all's plan and on a fine one.
IDEAL = "ideal"
EARLIEST = "earliest"
EARLIEST_FINE = "earliest-fine"
BOUNDS = (IDEAL, EARLIEST, EARLIEST_FINE)
# earliest-fine's plan: equal stages of about a thirty-second of the search each.
FINE_STAGES = 32


@dataclass(frozen=True)
class Point:
    """One point of the sweep: what sets its ratio and the ratio the calibration predicts."""

    kind: str
    knob: float  # IVF: share of the lists probed; HNSW: efSearch
    k: int
    predicted_ratio: float
    search_ms: float
    prefill_ms: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer queries, an 8M-vector index")
    add_model_option(
        parser, RANDOM_MODEL_NAME, "its size is set per machine so that search and prefill can cost the same"
    )
    parser.add_argument(
        "--kind", choices=SWEEP_KINDS, default="ivf-sq8", help="IVF kind of the sweep's index (lists' codes)"
    )
    parser.add_argument(
        "--index-size", type=int, help="vectors in the sweep's padded IVF index (default 12M, quick 8M)"
    )
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded indexes")
    parser.add_argument(
        "--flat-size",
        type=int,
        default=4_000_000,
        help="vectors in the padded flat IVF index of the extra point at r near 1 (0: none)",
    )
    parser.add_argument(
        "--hnsw-size", type=int, default=200_000, help="vectors in the padded HNSW index (0: no HNSW point)"
    )
    parser.add_argument(
        "--targets",
        type=lambda text: tuple(float(value) for value in text.split(",")),
        default=TARGET_RATIOS,
        help="search-to-prefill ratios of the idle sweep, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-queries", type=int, help="queries per idle configuration (default 32, quick 16)"
    )
    parser.add_argument(
        "--loaded-queries", type=int, help="queries per loaded configuration (default 48, quick 20)"
    )
    parser.add_argument(
        "--utilization", type=float, default=0.7, help="loaded arrival rate / saturation rate"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per answer")
    parser.add_argument(
        "--stages",
        type=int,
        help="stages per search in the speculating configurations (default: the index kind's, "
        + ", ".join(f"{stages} for {kind.upper()}" for kind, stages in DEFAULT_STAGES.items())
        + ")",
    )
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine's model worker")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.index_size = args.index_size or (8_000_000 if args.quick else 12_000_000)
    args.idle_queries = args.idle_queries or (16 if args.quick else 32)
    args.loaded_queries = args.loaded_queries or (20 if args.quick else 48)
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be between 0 and 1")
    return args


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


def embed_ms(record: dict[str, Any]) -> float:
    """Arrival to the search's start: the question's embedding."""
    return float(record.get("embed_ms") or 0.0)


def search_ms(record: dict[str, Any]) -> float:
    """The vector search alone: the timeline's ``retrieval_ms`` counts the embedding too."""
    return float(record["retrieval_ms"]) - embed_ms(record)


def _ok(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "error" not in r and r.get("ttft_ms") is not None]


def overlap(
    serial: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], ideal: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The bound from serial's timelines and ``other``'s share of the gain, over the same queries;
    with ``ideal`` (:mod:`bench.pipeline.ideal`) over the queries all three answered, also the
    share of the gain the ideal run measured on this machine."""
    base = {r["i"]: r for r in _ok(serial)}
    measured = {r["i"]: r["ttft_ms"] for r in ideal}
    paired = [
        (base[r["i"]], r) for r in _ok(other) if r["i"] in base and (not measured or r["i"] in measured)
    ]
    embed = np.array([embed_ms(s) for s, _ in paired])
    search = np.array([search_ms(s) for s, _ in paired])
    serial_ttft = np.array([s["ttft_ms"] for s, _ in paired])
    prefill = serial_ttft - embed - search
    bound = embed + np.maximum(search, prefill)
    config_ttft = np.array([o["ttft_ms"] for _, o in paired])
    gain = serial_ttft.mean() - bound.mean()
    of_ideal = {}
    if measured:
        ideal_ttft = np.array([measured[o["i"]] for _, o in paired])
        ideal_gain = serial_ttft.mean() - ideal_ttft.mean()
        replaced = np.array([replaced_guess(o) for _, o in paired])
        loss = config_ttft - ideal_ttft
        of_ideal = {
            "ideal_ttft_ms": float(ideal_ttft.mean()),
            "overlap_fraction_of_ideal": (
                float((serial_ttft.mean() - config_ttft.mean()) / ideal_gain) if ideal_gain > 0 else math.nan
            ),
            "overlap_fraction_of_ideal_ci": share_ci(serial_ttft - config_ttft, serial_ttft - ideal_ttft),
            # The mean loss against the ideal, and the part of it from queries whose speculated
            # top-k went stale (a guess no policy can know is wrong when it is made).
            "loss_vs_ideal_ms": float(loss.mean()),
            "loss_vs_ideal_from_stale_guesses_ms": float(loss[replaced].sum() / len(loss)),
            "queries_with_stale_guesses": int(replaced.sum()),
        }
    return {
        **of_ideal,
        "ratio": float(search.mean() / prefill.mean()),
        "embed_ms": float(embed.mean()),
        "search_ms": float(search.mean()),
        "prefill_ms": float(prefill.mean()),
        "serial_ttft_ms": float(serial_ttft.mean()),
        "config_ttft_ms": float(config_ttft.mean()),
        "bound_ttft_ms": float(bound.mean()),
        "overlap_fraction": float((serial_ttft.mean() - config_ttft.mean()) / gain) if gain > 0 else math.nan,
        "overlap_fraction_ci": share_ci(serial_ttft - config_ttft, serial_ttft - bound),
        # The timeline counts from the embedding's start; the search starts after it.
        "non_overlapped_over_search": float(
            np.mean([max(0.0, o["non_overlapped_retrieval_ms"] - embed_ms(o)) for _, o in paired])
            / search.mean()
        ),
    }


def share_ci(gains: np.ndarray, possible: np.ndarray) -> list[float]:
    """A 95 % interval of a share of the possible gain, ``sum(gains) / sum(possible)``, resampling
    the queries (each query's two gains together); NaN where the possible gain is none."""
    if len(gains) == 0 or possible.sum() <= 0:
        return [math.nan, math.nan]
    return [round(end, 3) for end in bootstrap_ratio_ci(gains, possible, np.random.default_rng(0))]


def replaced_guess(record: dict[str, Any]) -> bool:
    """Whether a query aborted a speculation because its top-k went stale."""
    return any(e["kind"] == "spec_abort" and e.get("reason") == "stale" for e in record.get("events", ()))


PHASES = (
    "search_end_to_submit_ms",
    "submit_to_queued_ms",
    "queued_to_scheduled_ms",
    "scheduled_to_engine_first_token_ms",
    "engine_to_received_ms",
    "received_to_seen_ms",
)


def phase_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each phase of the answers' way to their first token (``Timeline.phases``): mean and median
    over the answers that report it, and how often something else of ours shared the engine."""
    ok = _ok(records)
    result: dict[str, Any] = {}
    for name in PHASES:
        values = [r["phases"][name] for r in ok if r.get("phases", {}).get(name) is not None]
        result[name] = (
            {"mean": round(statistics.fmean(values), 2), "median": round(statistics.median(values), 2)}
            if values
            else None
        )
    beside = [r["phases"]["beside_at_submit"] for r in ok if "phases" in r]
    result["answers"] = len(ok)
    result["adopted"] = sum(1 for r in ok if r.get("adopted"))
    result["beside_prefilling_at_submit"] = sum(1 for b in beside if b.get("prefilling"))
    result["aborted_before_submit"] = sum(r["phases"]["aborted_before_submit"] for r in ok if "phases" in r)
    return result


def wasted_share(records: Sequence[dict[str, Any]]) -> float:
    """Wasted speculative prefill over all prefill the engine computed (answers' uncached + wasted)."""
    ok = _ok(records)
    wasted = sum(r["wasted_spec_prefill_tokens"] for r in ok)
    computed = sum(r["prompt_tokens"] - r["cached_prompt_tokens"] for r in ok) + wasted
    return wasted / computed if computed else 0.0


@dataclass
class Stack:
    """What every configuration of one run shares."""

    engine: Engine
    kv_events: KVEventSource | None
    builder: PromptBuilder
    base: ControllerConfig
    max_tokens: int


def halves(trace: Sequence[TraceQuery]) -> list[tuple[int, list[TraceQuery]]]:
    """The trace's two halves, each with the index of its first query and arrivals from 0."""
    middle = len(trace) // 2
    return [
        (start, [replace(query, t=query.t - part[0].t) for query in part])
        for start, part in ((0, list(trace[:middle])), (middle, list(trace[middle:])))
        if part
    ]


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
    answered = {r["i"]: r for r in _ok(serial.records)}
    plans = {
        IDEAL: None,
        EARLIEST: index.stage_plan(stack.base.num_stages, DEFAULT_SCHEDULE),
        EARLIEST_FINE: index.stage_plan(FINE_STAGES, Schedule.EQUAL),
    }
    for name in BOUNDS:
        started = time.perf_counter()
        found = await bound_records(
            stack.engine, index, half, first, point.k, answered, serial.prompts, plans[name]
        )
        bound = results.setdefault(
            name, RunResult(Configuration(name, name, "pipeline", math.nan), [], 0.0, serial.nprobe)
        )
        bound.records.extend(found)
        bound.wall_s += time.perf_counter() - started


def idle_trace(
    passages: Sequence[Passage], point: Point, n: int, max_tokens: int, seed: int
) -> list[TraceQuery]:
    """Near-regular arrivals far enough apart that each query runs alone."""
    gap_s = IDLE_GAP_FACTOR * (point.search_ms + point.prefill_ms) / 1000 + 0.05 * max_tokens + 0.2
    return generate(passages, "zipf", n, 1 / gap_s, cv=0.05, seed=seed)


def point_summary(point: Point, results: dict[str, RunResult], index: VectorIndex) -> dict[str, Any]:
    """The point's figures; ``search`` says whether its index searched hybrid (dense and BM25
    fused, as the service does) or dense only, so that points are compared like for like."""
    serial = results["serial"].records
    ideal = results[IDEAL].records if IDEAL in results else []
    runs = {name: run for name, run in results.items() if name not in BOUNDS}
    rows = {name: overlap(serial, run.records, ideal) for name, run in runs.items() if name != "serial"}
    earliest = {
        name: earliest_summary(serial, results[name].records, ideal)
        for name in (EARLIEST, EARLIEST_FINE)
        if name in results
    }
    return {
        "kind": point.kind,
        "search": "hybrid" if index.hybrid else "dense",
        "knob": point.knob,
        "k": point.k,
        "predicted_ratio": point.predicted_ratio,
        "nprobe": results["serial"].nprobe,
        "configurations": rows,
        "first_query_cached_tokens": {
            name: next((r["cached_prompt_tokens"] for r in _ok(run.records)), None)
            for name, run in runs.items()
        },
        "summaries": {name: summarize(run, {}, math.inf) for name, run in runs.items()},
        "phases": {name: phase_summary(run.records) for name, run in runs.items()},
        **({"ideal": ideal_summary(ideal)} if ideal else {}),
        **({"earliest": earliest} if earliest else {}),
    }


def ideal_summary(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The ideal run's means: its TTFT, its search and its prefill, each beside the other."""
    return {
        f"{figure}_mean": float(np.mean([r[figure] for r in records]))
        for figure in ("ttft_ms", "search_ms", "prefill_beside_search_ms")
    }


def earliest_summary(
    serial: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], ideal: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """An ``earliest`` run as a configuration's row (:func:`overlap`), with when it submitted:
    the mean time from the search's start and how many queries submitted at each stage."""
    by_stage = Counter(r["stage"] for r in records)
    return {
        **overlap(serial, records, ideal),
        "submitted_ms": float(np.mean([r["submitted_ms"] for r in records])),
        "queries_by_stage": {str(stage): by_stage[stage] for stage in sorted(by_stage)},
    }


def saturation_rps(serial: Sequence[dict[str, Any]]) -> float:
    """Queries per second one engine and one search thread sustain: 1 / the busier one's time."""
    ok = _ok(serial)
    engine_s = np.mean([r["e2e_ms"] - r["retrieval_ms"] for r in ok]) / 1000
    search_s = np.mean([search_ms(r) for r in ok]) / 1000
    return float(1 / max(engine_s, search_s))


async def hnsw_index(layout: DataLayout, assets: Assets, size: int, runner: SearchRunner) -> VectorIndex:
    """A padded HNSW index (built once); imported only now that the engine runs (numba, see index_store)."""
    directory = layout.root / f"index-scaled-hnsw-{size}-p{PADDING_VERSION}"
    print(f"padded HNSW index ({size:,} vectors) in {directory}: built if missing or stale", flush=True)
    index = ensure_index(layout, assets.passages, IndexConfig(kind="hnsw", pad_to=size), directory)
    index.use_runner(runner)
    return index


def with_ef_search(index: VectorIndex, ef_search: int) -> VectorIndex:
    """The same graph searched at ``ef_search`` (its stage sizes recalibrated), hybrid when the
    index is, like the IVF points: only the dense channel's search changes."""
    searcher: Any = index.searcher
    retuned = type(searcher)(searcher.owner, ef_search)
    return VectorIndex(
        retuned,
        index.passage_ids,
        index.synthetic_sources,
        index.embedder,
        index.runner,
        index.lexical,
        index.fusion,
    )


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
    codes = index.searcher.settings["codes"]
    print(
        f"one search (ms) by probe share, {codes} lists:",
        {f"{s:.3g}": round(v, 1) for s, v in search_ms.items()},
    )
    return search_ms


async def calibrate(
    stack: Stack, index: VectorIndex, queries: Sequence[str], vectors: np.ndarray
) -> tuple[dict[float, float], dict[int, float]]:
    """One search per probe share and one prefill per prompt size, to choose the sweep's points."""
    search_ms = await search_ms_by_share(index, vectors)
    prefill_ms = await prefill_ms_by_k(stack.engine, index, stack.builder, queries, vectors)
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


async def idle_sweep(
    stack: Stack,
    index: VectorIndex,
    passages: Sequence[Passage],
    points: Sequence[Point],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], list[dict[str, RunResult]]]:
    summaries, runs = [], []
    for number, point in enumerate(points):
        trace = idle_trace(passages, point, args.idle_queries, args.max_tokens, args.seed + number)
        results = await run_all(stack, index, point, trace)
        summaries.append(point_summary(point, results, index))
        runs.append(results)
        print_point(summaries[-1], "idle")
    return summaries, runs


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
    trace = idle_trace(assets.passages, hnsw_at, args.idle_queries, args.max_tokens, args.seed + 70)
    runs = await run_all(stack, hnsw, hnsw_at, trace)
    summary = point_summary(hnsw_at, runs, graph)
    print_point(summary, "idle")
    return summary, runs


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
    point = nearest_point("ivf", await search_ms_by_share(flat, vectors), prefill_ms, 1.0)
    trace = idle_trace(passages, point, args.idle_queries, args.max_tokens, args.seed + 80)
    runs = await run_all(stack, flat, point, trace)
    summary = point_summary(point, runs, flat)
    print_point(summary, "idle, flat IVF")
    return summary, runs


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    index = scaled_index(layout, assets, args.index_size, args.nlist, args.kind)
    flat = scaled_index(layout, assets, args.flat_size, args.nlist) if args.flat_size else None
    runner = SearchRunner(threads=1, cpus=parse_cpus(args.search_cpus, "--search-cpus"))
    for searched in (index, flat):
        if searched is not None:
            searched.use_runner(runner)
    pinning = (
        f"engine (all threads of its engine-core and model-worker processes) on core(s) {args.engine_cpus}, "
        f"the service (event loop, vector search) on core(s) {args.search_cpus}"
    )
    print(f"{pinning}; {args.kind} index {index.searcher.ntotal:,} vectors, nlist {args.nlist}", flush=True)
    rng = np.random.default_rng(args.seed + 99)
    picks = rng.integers(0, len(assets.passages), CALIBRATION_QUERIES)
    queries = [assets.passages[int(i)].text[:120] for i in picks]
    vectors = np.stack([index.embed_query(q) for q in queries])
    options = ServiceOptions(eager=args.eager, engine_cpus=args.engine_cpus)
    try:
        async with open_engine(assets.model_dir, options, layout.root / "run" / "pipeline") as opened:
            engine, kv_events = opened
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
            stack = Stack(engine, kv_events, builder, base, args.max_tokens)
            search_ms, prefill_ms = await calibrate(stack, index, queries, vectors)
            sweep = sweep_points(search_ms, prefill_ms, args.targets)
            idle, idle_runs = await idle_sweep(stack, index, assets.passages, sweep, args)
            nearest_one = min(
                range(len(idle)), key=lambda i: abs(math.log(idle[i]["configurations"]["all"]["ratio"]))
            )
            loaded, loaded_runs = await loaded_run(
                stack,
                index,
                assets.passages,
                sweep[nearest_one],
                idle_runs[nearest_one]["serial"].records,
                args,
            )
            hnsw_summary, hnsw_runs = await graph_point(
                stack, layout, assets, runner, vectors, prefill_ms, args
            )
            flat_summary, flat_runs = await flat_point(
                stack, flat, assets.passages, vectors, prefill_ms, args
            )
    finally:
        runner.shutdown()
    facts = {
        **machine(),
        "pinning": pinning,
        "engine_cpus": args.engine_cpus,
        "search_cpus": args.search_cpus,
        "model": str(assets.model_dir),
        "index": {"vectors": args.index_size, "nlist": args.nlist, "kind": args.kind},
        "flat_vectors": args.flat_size,
        "hnsw_vectors": args.hnsw_size,
        "idle_queries": args.idle_queries,
        "loaded_queries": args.loaded_queries,
        "max_tokens": args.max_tokens,
        "default_schedule": DEFAULT_SCHEDULE,
        "stages": {kind: args.stages or default for kind, default in DEFAULT_STAGES.items()},
        "search_ms_by_probe_share": {str(s): v for s, v in search_ms.items()},
        "prefill_ms_by_k": {str(k): v for k, v in prefill_ms.items()},
    }
    records = {
        **{f"idle-{i}": runs for i, runs in enumerate(idle_runs)},
        "loaded": loaded_runs,
        **({"hnsw": hnsw_runs} if hnsw_runs else {}),
        **({"ivf_flat": flat_runs} if flat_runs else {}),
    }
    raw = {key: {name: run.records for name, run in runs.items()} for key, runs in records.items()}
    result = {"facts": facts, "idle": idle, "loaded": loaded, "hnsw": hnsw_summary, "ivf_flat": flat_summary}
    write_json("pipeline", {**result, "records": raw})
    plot(idle, hnsw_summary, flat_summary, args.kind)
    return result


def loaded_summary(
    point: Point, results: dict[str, RunResult], index: VectorIndex, utilization: float, saturation: float
) -> dict[str, Any]:
    summary = point_summary(point, results, index)
    serial = summary["summaries"]["serial"]
    summary.update(
        utilization=utilization,
        saturation_rps=saturation,
        ttft_mean_over_serial={
            n: s["ttft_mean_ms"] / serial["ttft_mean_ms"] for n, s in summary["summaries"].items()
        },
        ttft_p99_over_serial={
            n: s["ttft_p99_ms"] / serial["ttft_p99_ms"] for n, s in summary["summaries"].items()
        },
        wasted_spec_prefill_share={n: wasted_share(run.records) for n, run in results.items()},
    )
    return summary


def print_point(summary: dict[str, Any], label: str) -> None:
    rows = summary["configurations"]
    first = next(iter(rows.values()))
    print(
        f"{label} {summary['kind']} ({summary['search']} search) knob {summary['knob']:.3g} k={summary['k']}:"
        f" measured r = {first['ratio']:.2f} (predicted {summary['predicted_ratio']:.2f});"
        f" serial {first['serial_ttft_ms']:.0f} ms, bound {first['bound_ttft_ms']:.0f} ms;"
        f" first query's cached tokens {summary['first_query_cached_tokens']}"
    )
    if "ideal" in summary:
        ideal = summary["ideal"]
        print(
            f"    ideal (final prompt from the search's start): TTFT {ideal['ttft_ms_mean']:.0f} ms,"
            f" search {ideal['search_ms_mean']:.0f} ms,"
            f" prefill beside it {ideal['prefill_beside_search_ms_mean']:.0f} ms"
        )
    for name, bound in summary.get("earliest", {}).items():
        print(
            f"    {name} (final prompt from the first stage holding it, {bound['submitted_ms']:.0f} ms in):"
            f" TTFT {bound['config_ttft_ms']:.0f} ms, overlap_fraction {bound['overlap_fraction']:.2f}"
            f" {interval(bound['overlap_fraction_ci'])},"
            f" of ideal {bound.get('overlap_fraction_of_ideal', math.nan):.2f};"
            f" queries by stage {bound['queries_by_stage']}"
        )
    for name, row in rows.items():
        print(
            f"    {name:<16} TTFT {row['config_ttft_ms']:7.0f} ms"
            f"  overlap_fraction {row['overlap_fraction']:6.2f} {interval(row['overlap_fraction_ci'])}"
            f"  of ideal {row.get('overlap_fraction_of_ideal', math.nan):6.2f}"
            f"  stale guesses {row.get('queries_with_stale_guesses', '-')}"
            f"  non-overlapped / search {row['non_overlapped_over_search']:.2f}"
        )
    print_phases(summary["phases"])
    print(flush=True)


def interval(ends: Sequence[float]) -> str:
    return f"[{ends[0]:.2f}, {ends[1]:.2f}]"


def print_phases(phases: dict[str, dict[str, Any]]) -> None:
    """serial's and all's answers, phase by phase (median ms), side by side."""
    shown = [name for name in ("serial", "all") if name in phases]
    print("    phases of the answer's first token, median ms: " + " / ".join(shown))
    for phase in PHASES:
        cells = [phases[name][phase] for name in shown]
        text = " / ".join("-" if cell is None else f"{cell['median']:.1f}" for cell in cells)
        print(f"      {phase.removesuffix('_ms'):<34} {text}")
    for name in shown:
        figures = phases[name]
        print(
            f"      {name}: {figures['adopted']} of {figures['answers']} adopted,"
            f" {figures['beside_prefilling_at_submit']} submitted beside a prefill of ours,"
            f" {figures['aborted_before_submit']} speculations aborted before their answer"
        )


def print_loaded(summary: dict[str, Any]) -> None:
    first = summary["configurations"]["all"]
    print(
        f"loaded at utilization {summary['utilization']:.2f} of {summary['saturation_rps']:.2f} queries/s,"
        f" measured r = {first['ratio']:.2f}; serial TTFT {first['serial_ttft_ms']:.0f} ms"
    )
    for name in summary["configurations"]:
        print(
            f"    {name:<16} mean TTFT {summary['ttft_mean_over_serial'][name]:.2f}x serial,"
            f" p99 {summary['ttft_p99_over_serial'][name]:.2f}x,"
            f" wasted speculative prefill {summary['wasted_spec_prefill_share'][name]:.1%} of all prefill"
        )
    print(flush=True)


def plot(
    points: Sequence[dict[str, Any]], hnsw: dict[str, Any] | None, flat: dict[str, Any] | None, kind: str
) -> Path:
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ratios = [p["configurations"]["all"]["ratio"] for p in points]
    order = np.argsort(ratios)
    x = [ratios[i] for i in order]
    # One colour per configuration in both panels (serial has no overlap_fraction of its own).
    colours = dict(
        zip(points[0]["summaries"], plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False)
    )
    serial_ttft = [points[i]["configurations"]["all"]["serial_ttft_ms"] for i in order]
    left.plot(x, serial_ttft, marker="o", label="serial", color=colours["serial"])
    for name in points[0]["configurations"]:
        style = {"marker": "o", "label": name, "color": colours[name]}
        left.plot(x, [points[i]["configurations"][name]["config_ttft_ms"] for i in order], **style)
        right.plot(x, [points[i]["configurations"][name]["overlap_fraction"] for i in order], **style)
    left.plot(
        x,
        [points[i]["configurations"]["all"]["bound_ttft_ms"] for i in order],
        ls="--",
        color="black",
        label="overlap bound",
    )
    extras = {"all, HNSW": (hnsw, "*"), "all, flat IVF": (flat, "X")}
    for label, (summary, marker) in extras.items():
        if summary is not None:
            row = summary["configurations"]["all"]
            right.scatter(
                [row["ratio"]], [row["overlap_fraction"]], marker=marker, s=150, color="black", label=label
            )
    left.set(
        xscale="log", xlabel="measured search / prefill ratio r", ylabel="mean TTFT (ms), one query at a time"
    )
    right.set(
        xscale="log", xlabel="measured search / prefill ratio r", ylabel="overlap_fraction (1 = the bound)"
    )
    right.axhline(1.0, color="grey", linewidth=0.5)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"Speculative pipelining against the search-to-prefill ratio ({kind}, idle)")
    figure.tight_layout()
    path = plot_path("pipeline")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def extra_point(summary: dict[str, Any]) -> dict[str, Any]:
    """``all``'s figures at one extra idle point."""
    row = summary["configurations"]["all"]
    return {
        "ratio": round(row["ratio"], 3),
        "overlap_fraction": round(row["overlap_fraction"], 3),
        "overlap_fraction_ci": row["overlap_fraction_ci"],
        **of_ideal(row),
        **of_earliest(summary),
        "non_overlapped_over_search": round(row["non_overlapped_over_search"], 3),
        "phases": {name: phase_medians(summary, name) for name in ("serial", "all")},
    }


def of_ideal(row: dict[str, Any]) -> dict[str, Any]:
    """A configuration's ideal TTFT and its share of the ideal's gain, where the point ran one."""
    if "ideal_ttft_ms" not in row:
        return {}
    return {
        "ideal_ttft_ms": round(row["ideal_ttft_ms"], 1),
        "overlap_fraction_of_ideal": round(row["overlap_fraction_of_ideal"], 3),
        "overlap_fraction_of_ideal_ci": row["overlap_fraction_of_ideal_ci"],
        "loss_vs_ideal_ms": round(row["loss_vs_ideal_ms"], 1),
        "loss_vs_ideal_from_stale_guesses_ms": round(row["loss_vs_ideal_from_stale_guesses_ms"], 1),
        "queries_with_stale_guesses": row["queries_with_stale_guesses"],
    }


def of_earliest(point: dict[str, Any]) -> dict[str, Any]:
    """Each earliest run's overlap and ``all``'s share of its gain, where the point ran them."""
    row = point["configurations"]["all"]
    result = {}
    for name, bound in point.get("earliest", {}).items():
        key = name.replace("-", "_")
        gain = bound["serial_ttft_ms"] - bound["config_ttft_ms"]
        result[f"{key}_overlap_fraction"] = round(bound["overlap_fraction"], 3)
        result[f"{key}_overlap_fraction_ci"] = bound["overlap_fraction_ci"]
        result[f"all_share_of_{key}"] = (
            round((row["serial_ttft_ms"] - row["config_ttft_ms"]) / gain, 3) if gain > 0 else math.nan
        )
    return result


def idle_row(point: dict[str, Any]) -> dict[str, Any]:
    """One idle point's figures for ``all`` (speculation priced) beside ``all-always``."""
    row, always = point["configurations"]["all"], point["configurations"]["all-always"]
    return {
        "ratio": round(row["ratio"], 3),
        "serial_ttft_ms": round(row["serial_ttft_ms"], 1),
        "all_ttft_ms": round(row["config_ttft_ms"], 1),
        "all_always_ttft_ms": round(always["config_ttft_ms"], 1),
        "all_over_serial": round(row["config_ttft_ms"] / row["serial_ttft_ms"], 3),
        "all_always_over_serial": round(always["config_ttft_ms"] / row["serial_ttft_ms"], 3),
        "bound_ttft_ms": round(row["bound_ttft_ms"], 1),
        "overlap_fraction": round(row["overlap_fraction"], 3),
        "overlap_fraction_ci": row["overlap_fraction_ci"],
        "overlap_fraction_always": round(always["overlap_fraction"], 3),
        **of_ideal(row),
        **of_earliest(point),
        "non_overlapped_over_search": round(row["non_overlapped_over_search"], 3),
        "speculations_per_query": {
            name: round(
                point["summaries"][name]["speculations"]
                / max(1, point["summaries"][name]["requests"] - point["summaries"][name]["errors"]),
                2,
            )
            for name in ("all", "all-always")
        },
    }


def phase_medians(point: dict[str, Any], name: str) -> dict[str, float | None]:
    """``name``'s median of each phase of the answers' first token at one point."""
    phases = point["phases"][name]
    return {phase: None if phases[phase] is None else phases[phase]["median"] for phase in PHASES}


def near_r1(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The guard: at the idle point nearest r = 1, ``all``'s overlap and where serial's and
    all's first tokens spent their time after the search (the phases, median ms)."""
    point = min(points, key=lambda p: abs(math.log(p["configurations"]["all"]["ratio"])))
    row = point["configurations"]["all"]
    above = row["config_ttft_ms"] - row["bound_ttft_ms"]
    non_overlapped_ms = row["non_overlapped_over_search"] * row["search_ms"]
    return {
        "ratio": round(row["ratio"], 3),
        "overlap_fraction": round(row["overlap_fraction"], 3),
        "overlap_fraction_ci": row["overlap_fraction_ci"],
        **of_ideal(row),
        **of_earliest(point),
        "non_overlapped_over_search": round(row["non_overlapped_over_search"], 3),
        "above_bound_ms": round(above, 1),
        # What the search the answer's prefill did not overlap leaves unexplained: time lost after
        # the prefill began (a slower prefill, a later token), which the phases then locate.
        "above_bound_after_prefill_start_ms": round(above - non_overlapped_ms, 1),
        "phases": {name: phase_medians(point, name) for name in ("serial", "all")},
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's last-line summary, for ``all`` on the default schedule beside ``all-always``."""
    loaded = result["loaded"]
    idle = sorted((idle_row(p) for p in result["idle"]), key=lambda r: r["ratio"])
    return {
        "idle": idle,
        "low_r": idle[0],
        "near_r1": near_r1(result["idle"]),
        "loaded": {
            "ratio": round(loaded["configurations"]["all"]["ratio"], 3),
            "utilization": round(loaded["utilization"], 3),
            **{
                f"{figure}_{name.replace('-', '_')}": round(loaded[key][name], 4)
                for name in ("all", "all-always")
                for figure, key in (
                    ("ttft_mean_over_serial", "ttft_mean_over_serial"),
                    ("ttft_p99_over_serial", "ttft_p99_over_serial"),
                    ("wasted_spec_prefill_share", "wasted_spec_prefill_share"),
                )
            },
        },
        **({"hnsw": extra_point(result["hnsw"])} if result["hnsw"] else {}),
        **({"ivf_flat": extra_point(result["ivf_flat"])} if result["ivf_flat"] else {}),
        "index": result["facts"]["index"],
        "schedule": DEFAULT_SCHEDULE,
        "stages": result["facts"]["stages"],
        "pinning": result["facts"]["pinning"],
    }


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    result = run_measurement(run(args))
    wall_s = time.perf_counter() - started
    print(f"wrote {plot_path('pipeline').parent}/pipeline.json and pipeline.png in {wall_s:.0f} s")
    print_summary(headline(result), "bench.pipeline --quick   (full: drop --quick)")


if __name__ == "__main__":
    main()
