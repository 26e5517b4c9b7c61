"""bench.pipeline's figures from the per-request records: pure functions, no engine.

The overlap bound from serial's own timelines and each configuration's share of the gain
(:func:`overlap`), the phases of the answers' first token, the wasted speculative prefill, the
saturation rate and the summaries of a point. Kept apart from the runs so that the arithmetic is
tested on hand-made records and can be rerun on a stored ``pipeline.json``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.common import bootstrap_ratio_ci
from bench.e2e.report import answered, summarize
from bench.e2e.runner import RunResult
from bench.pipeline.calibration import Point
from specrag.retrieval.vector_index import VectorIndex

# The measured bounds' runs (bench.pipeline.ideal) among a point's results: the final prompt from
# the search's start, and from the end of the first stage holding it on all's plan and on a fine one.
IDEAL = "ideal"
EARLIEST = "earliest"
EARLIEST_FINE = "earliest-fine"
BOUNDS = (IDEAL, EARLIEST, EARLIEST_FINE)
PHASES = (
    "search_end_to_submit_ms",
    "submit_to_queued_ms",
    "queued_to_scheduled_ms",
    "scheduled_to_engine_first_token_ms",
    "engine_to_received_ms",
    "received_to_seen_ms",
)


def embed_ms(record: dict[str, Any]) -> float:
    """Arrival to the search's start: the question's embedding."""
    return float(record.get("embed_ms") or 0.0)


def search_ms(record: dict[str, Any]) -> float:
    """The vector search alone: the timeline's ``retrieval_ms`` counts the embedding too."""
    return float(record["retrieval_ms"]) - embed_ms(record)


def overlap(
    serial: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], ideal: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The bound from serial's timelines and ``other``'s share of the gain, over the same queries;
    with ``ideal`` (:mod:`bench.pipeline.ideal`) over the queries all three answered, also the
    share of the gain the ideal run measured on this machine."""
    base = {r["i"]: r for r in answered(serial)}
    measured = {r["i"]: r["ttft_ms"] for r in ideal}
    paired = [
        (base[r["i"]], r) for r in answered(other) if r["i"] in base and (not measured or r["i"] in measured)
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


def phase_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each phase of the answers' way to their first token (``Timeline.phases``): mean and median
    over the answers that report it, and how often something else of ours shared the engine."""
    ok = answered(records)
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
    ok = answered(records)
    wasted = sum(r["wasted_spec_prefill_tokens"] for r in ok)
    computed = sum(r["prompt_tokens"] - r["cached_prompt_tokens"] for r in ok) + wasted
    return wasted / computed if computed else 0.0


def saturation_rps(serial: Sequence[dict[str, Any]]) -> float:
    """Queries per second one engine and one search thread sustain: 1 / the busier one's time."""
    ok = answered(serial)
    engine_s = np.mean([r["e2e_ms"] - r["retrieval_ms"] for r in ok]) / 1000
    search_s = np.mean([search_ms(r) for r in ok]) / 1000
    return float(1 / max(engine_s, search_s))


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
            name: next((r["cached_prompt_tokens"] for r in answered(run.records)), None)
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
