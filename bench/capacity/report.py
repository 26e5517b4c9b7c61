"""bench.capacity's figures: one point per offered rate, the capacity rule, the summary and the plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.capacity.load import Answer
from bench.capacity.meters import COMPONENTS
from bench.common import save_figure

__all__ = [
    "ADDED_TTFT_BOUND_MS",
    "ELSEWHERE",
    "capacity_of",
    "draw",
    "profile_per_answer",
    "rate_point",
    "summary",
]

ADDED_TTFT_BOUND_MS = 10.0
"""The added time to first token, at p99, within which a rate counts as held (docs/capacity.md)."""
ELSEWHERE = "-embedding-elsewhere"
"""The suffix of a run, and of its headline keys, whose questions an embedding server embedded."""


def _percentile(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def rate_point(
    rate: float,
    seconds: float,
    answers: Sequence[Answer],
    records: Mapping[str, Mapping[str, Any]],
    cpu_before: Mapping[str, float],
    cpu_after: Mapping[str, float],
    mirrors: Sequence[Mapping[str, Any]],
    events: int,
) -> dict[str, Any]:
    """What one offered rate did: answers/s served, added TTFT (the client's TTFT less the
    stand-in's own modelled TTFT for the request the answer came from), CPU ms per answer by
    component, the mirrors' state and the KV events the stand-ins published a second."""
    done = [answer for answer in answers if answer.error is None and answer.ttft_s is not None]
    added, late, unmatched = [], [], 0
    for answer in done:
        record = records.get(answer.request_id or "")
        if record is None or record.get("modelled_ttft_s") is None:
            unmatched += 1
            continue
        added.append((answer.ttft_s - float(record["modelled_ttft_s"])) * 1000)  # type: ignore[operator]
        late.append(float(record["late_s"]) * 1000)
    window = max((answer.sent_at + (answer.done_s or 0.0) for answer in done), default=0.0) - min(
        (answer.sent_at for answer in answers), default=0.0
    )
    served = len(done) / max(window, seconds) if done else 0.0
    cpu_ms = {
        key: round((cpu_after[key] - cpu_before[key]) * 1000 / max(1, len(done)), 3)
        for key in (*COMPONENTS, "total")
    }
    predictions = [a for a in done if a.predicted_cached is not None and a.delivered_cached is not None]
    searched = [answer.unstaged for answer in done if answer.unstaged is not None]
    return {
        "offered_per_s": rate,
        "sent": len(answers),
        "answered": len(done),
        "failed": len(answers) - len(done),
        "errors": sorted({answer.error for answer in answers if answer.error})[:5],
        "answers_per_s": round(served, 3),
        "added_ttft_ms": {"p50": _percentile(added, 50), "p99": _percentile(added, 99), "n": len(added)},
        "client_ttft_ms_p50": _percentile([a.ttft_s * 1000 for a in done if a.ttft_s is not None], 50),
        "stand_in_late_ms": {"p50": _percentile(late, 50), "p99": _percentile(late, 99)},
        "client_send_late_ms_p99": _percentile([a.send_late_s * 1000 for a in answers], 99),
        "unmatched_answers": unmatched,
        "cpu_ms_per_answer": cpu_ms,
        "predicted_equals_delivered": (
            sum(a.predicted_cached == a.delivered_cached for a in predictions) / len(predictions)
            if predictions
            else None
        ),
        "predictions": len(predictions),
        # Requests the stand-ins finished a served answer (speculations and warm-ups included).
        "engine_requests_per_answer": round(len(records) / len(done), 3) if done else None,
        "searches_in_one_stage": round(sum(searched) / len(searched), 3) if searched else None,
        "mirrors": list(mirrors),
        "kv_events_per_s": round(events / seconds, 1),
    }


def profile_per_answer(figures: Mapping[str, Any], answered: int) -> dict[str, Any]:
    """A front's sampled profile of a sweep (:func:`bench.capacity.serving.profile_figures`) as CPU
    ms per answer served. The sampler's own CPU is apart (``sampler``): the meters' process CPU in
    a profiled run includes it, so compare CPU per answer between runs without ``--profile``."""
    count = max(1, answered)

    def per(seconds: float) -> float:
        return round(1000 * seconds / count, 3)

    components = sorted(figures["by_component_s"].items(), key=lambda item: -item[1])
    return {
        "answers": answered,
        "process_ms": per(figures["process_cpu_s"]),
        "loop_thread_ms": per(figures["loop_thread_cpu_s"]),
        "sampler_ms": per(figures["sampler_cpu_s"]),
        "by_component_ms": {name: per(seconds) for name, seconds in components},
        "top_self_ms": [[site, per(seconds)] for site, seconds in figures["top_self_s"]],
        "top_inclusive_ms": [[site, per(seconds)] for site, seconds in figures["top_inclusive_s"]],
    }


def holds(point: Mapping[str, Any]) -> bool:
    """Nothing failed and the added TTFT's p99 is within the bound."""
    p99 = point["added_ttft_ms"]["p99"]
    return (
        point["failed"] == 0
        and point["unmatched_answers"] == 0
        and p99 is not None
        and p99 <= ADDED_TTFT_BOUND_MS
    )


def capacity_of(points: Sequence[Mapping[str, Any]]) -> tuple[float, Mapping[str, Any] | None]:
    """The answers/s served at the highest offered rate that held (0 and None when none did)."""
    held = [point for point in points if holds(point)]
    if not held:
        return 0.0, None
    best = max(held, key=lambda point: point["offered_per_s"])
    return float(best["answers_per_s"]), best


def summary(runs: Mapping[str, Sequence[Mapping[str, Any]]], replicas: int) -> dict[str, Any]:
    """The headline keys, for specrag and the thin front in front of ``replicas`` stand-ins, their
    questions embedded in process; then the same keys (suffixed ``_embedding_elsewhere``) of the
    runs whose questions an embedding server embedded, when there are any."""
    headline = _fronts(runs, replicas, "")
    if f"specrag-{replicas}{ELSEWHERE}" in runs:
        suffix = ELSEWHERE.replace("-", "_")
        elsewhere = _fronts(runs, replicas, ELSEWHERE)
        headline |= {f"{key}{suffix}": elsewhere[key] for key in _PER_CONFIGURATION}
    specrag_points = [
        point for name, points in runs.items() if name.startswith("specrag") for point in points
    ]
    predictions = sum(point["predictions"] for point in specrag_points)
    equal = sum((point["predicted_equals_delivered"] or 0) * point["predictions"] for point in specrag_points)
    last_mirrors = [runs[name][-1]["mirrors"] for name in runs if name.startswith("specrag") and runs[name]]
    return headline | {
        "mirror_lost_batches": sum(m.get("lost_batches", 0) for mirrors in last_mirrors for m in mirrors),
        "mirror_exact_at_end": all(m.get("exact", False) for mirrors in last_mirrors for m in mirrors),
        "mirror_predicted_equals_delivered": round(equal / predictions, 4) if predictions else None,
        "capacities": {name: capacity_of(points)[0] for name, points in runs.items()},
    }


# The headline keys each embedding configuration has.
_PER_CONFIGURATION = (
    "capacity_answers_per_s",
    "capacity_offered_per_s",
    "thin_capacity_answers_per_s",
    "capacity_ratio_vs_thin",
    "added_ttft_p99_ms_at_half_capacity",
    "half_capacity_offered_per_s",
    "cpu_ms_per_answer",
    "most_served_per_s",
    "thin_most_served_per_s",
    "most_served_ratio_vs_thin",
)


def _fronts(runs: Mapping[str, Sequence[Mapping[str, Any]]], replicas: int, suffix: str) -> dict[str, Any]:
    """Capacities, ratio, added TTFT at half capacity and CPU per answer of the two fronts' runs
    named with ``suffix``."""
    capacity, at = capacity_of(runs[f"specrag-{replicas}{suffix}"])
    thin, thin_at = capacity_of(runs[f"thin-{replicas}{suffix}"])
    half = (
        min(runs[f"specrag-{replicas}{suffix}"], key=lambda p: abs(p["offered_per_s"] - capacity / 2))
        if capacity
        else None
    )
    most, thin_most = (
        _most_served(runs[f"specrag-{replicas}{suffix}"]),
        _most_served(runs[f"thin-{replicas}{suffix}"]),
    )
    return {
        "replicas": replicas,
        "capacity_answers_per_s": capacity,
        "capacity_offered_per_s": at["offered_per_s"] if at else None,
        "thin_capacity_answers_per_s": thin,
        "capacity_ratio_vs_thin": round(capacity / thin, 3) if thin else None,
        "added_ttft_p99_ms_at_half_capacity": half["added_ttft_ms"]["p99"] if half else None,
        "half_capacity_offered_per_s": half["offered_per_s"] if half else None,
        "cpu_ms_per_answer": {
            "specrag": (at or _busiest(runs[f"specrag-{replicas}{suffix}"]))["cpu_ms_per_answer"],
            "thin": (thin_at or _busiest(runs[f"thin-{replicas}{suffix}"]))["cpu_ms_per_answer"],
        },
        # Whatever the added TTFT: where no rate holds the bound (as on a 2-core machine), what
        # each front served at most still compares them.
        "most_served_per_s": most,
        "thin_most_served_per_s": thin_most,
        "most_served_ratio_vs_thin": round(most / thin_most, 3) if thin_most else None,
    }


def _most_served(points: Sequence[Mapping[str, Any]]) -> float:
    """The most answers/s served at any offered rate with nothing failed (0 when none)."""
    return max((float(point["answers_per_s"]) for point in points if point["failed"] == 0), default=0.0)


def _busiest(points: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return max(points, key=lambda point: point["answers_per_s"])


def draw(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> None:
    figure, (served, added) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in runs.items():
        rates = [point["offered_per_s"] for point in points]
        style = "-" if name.startswith("specrag") else "--"
        marker = "s" if name.endswith(ELSEWHERE) else "o"
        served.plot(rates, [point["answers_per_s"] for point in points], style, marker=marker, label=name)
        p99 = [point["added_ttft_ms"]["p99"] for point in points]
        added.plot(rates, [np.nan if v is None else v for v in p99], style, marker=marker, label=name)
    served.set(xlabel="offered answers/s (Poisson)", ylabel="answers/s served", title="Served")
    added.axhline(ADDED_TTFT_BOUND_MS, color="grey", linewidth=0.8)
    added.set(
        xlabel="offered answers/s (Poisson)",
        ylabel="added TTFT p99 (ms)",
        title="Added TTFT p99",
        yscale="log",
    )
    for axis in (served, added):
        axis.set_xscale("symlog", linthresh=1.0)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    save_figure(figure, path)
