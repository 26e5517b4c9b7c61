"""What ``bench.quality``'s answers add up to: each configuration's metrics with bootstrap
intervals and paired differences, the embedders compared, answers computed together against those
computed alone, the plot and the last line's summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.common import bootstrap_mean_ci, plot_path, save_figure

__all__ = [
    "BASELINES",
    "EMBEDDER_CONFIGS",
    "METRICS",
    "agreement",
    "bar_chart",
    "by_gold_position",
    "compare_embedders",
    "headline",
    "interval",
    "plot",
    "summarize",
]

METRICS = ("accuracy", "exact_match", "f1")


EMBEDDER_CONFIGS = ("serial", "ordering_no_hint")
"""Configurations answered again on each compared embedder's index: plain RAG, and ``serve``'s default."""


def agreement(together: Sequence[dict[str, Any]], alone: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many answers computed together equal those computed alone, token for token and in
    correctness."""
    pairs = list(zip(together, alone, strict=True))
    return {
        "questions": len(pairs),
        "identical_tokens": sum(a["tokens"] == b["tokens"] for a, b in pairs),
        "same_accuracy": sum(a["accuracy"] == b["accuracy"] for a, b in pairs),
    }


BASELINES = {"multiturn_dedup": ("multiturn_full", "full_history"), "multiturn_full": None, "serial": None}
"""What each configuration is compared with, paired question by question (default: serial)."""


def by_gold_position(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Accuracy by the answering passage's place in the prompt (1 = first, 0 = not retrieved)."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        order = row["prompt_rows"]
        position = order.index(row["gold_row"]) + 1 if row["gold_row"] in order else 0
        groups.setdefault(position, []).append(row["accuracy"])
    return {
        str(position): {"questions": len(values), "accuracy": float(np.mean(values))}
        for position, values in sorted(groups.items())
    }


def summarize(results: dict[str, list[dict[str, Any]]], seed: int) -> dict[str, dict[str, Any]]:
    """Each configuration's metrics with intervals, and its paired difference to its baseline."""
    rng = np.random.default_rng(seed)
    summary: dict[str, dict[str, Any]] = {}
    for name, rows in results.items():
        entry: dict[str, Any] = {"questions": len(rows)}
        for metric in METRICS:
            values = np.array([r[metric] for r in rows])
            entry[metric] = float(values.mean())
            entry[f"{metric}_ci"] = bootstrap_mean_ci(values, rng)
        baseline, label = BASELINES.get(name, ("serial", "serial")) or (None, None)
        if baseline is not None:
            for metric in ("accuracy", "f1"):
                delta = np.array([r[metric] for r in rows]) - np.array([r[metric] for r in results[baseline]])
                entry[f"{metric}_delta_vs_{label}"] = float(delta.mean())
                entry[f"{metric}_delta_vs_{label}_ci"] = bootstrap_mean_ci(delta, rng)
            entry[f"delta_vs_{label}_ci"] = entry[f"accuracy_delta_vs_{label}_ci"]
        if rows and "gold_retrieved" in rows[0]:
            entry["gold_retrieved"] = float(np.mean([r["gold_retrieved"] for r in rows]))
            entry["reordered"] = float(np.mean([r["reordered"] for r in rows]))
            entry["by_gold_position"] = by_gold_position(rows)
        summary[name] = entry
    speculation, serial = results["speculation"], results["serial"]
    pairs = list(zip(speculation, serial, strict=True))
    adopted = [(s, b) for s, b in pairs if s["adopted"]]
    summary["speculation"]["adopted"] = len(adopted) / len(pairs)
    summary["speculation"]["identical_to_serial"] = (
        float(np.mean([s["tokens"] == b["tokens"] for s, b in adopted])) if adopted else None
    )
    summary["speculation"]["identical_to_serial_all"] = float(
        np.mean([s["tokens"] == b["tokens"] for s, b in pairs])
    )
    return summary


def _mean_ci(values: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    return {"mean": float(values.mean()), "ci": bootstrap_mean_ci(values, rng)}


def compare_embedders(
    results: dict[str, list[dict[str, Any]]], main: str, others: Sequence[str], seed: int
) -> dict[str, dict[str, Any]]:
    """Does better retrieval raise accuracy? For each of :data:`EMBEDDER_CONFIGS` and each
    embedder, the share of questions whose answering passage was in the top k and the accuracy,
    and the paired differences ``main`` − other (the same questions, resampled together)."""
    rng = np.random.default_rng(seed)
    comparison: dict[str, dict[str, Any]] = {}
    for config in EMBEDDER_CONFIGS:
        rows = {main: results[config]} | {other: results[f"{config}@{other}"] for other in others}
        values = {
            name: {
                metric: np.array([r[metric] for r in mine], dtype=float)
                for metric in ("gold_retrieved", "accuracy")
            }
            for name, mine in rows.items()
        }
        entry: dict[str, Any] = {
            name: {metric: _mean_ci(array, rng) for metric, array in mine.items()}
            for name, mine in values.items()
        }
        for other in others:
            entry[f"{main}_minus_{other}"] = {
                metric: _mean_ci(values[main][metric] - values[other][metric], rng)
                for metric in ("gold_retrieved", "accuracy")
            }
        comparison[config] = entry
    return comparison


Series = tuple[str, Sequence[float], Sequence[Sequence[float]]]
"""One bar per configuration: the label, the means and their 95 % intervals."""


def bar_chart(
    name: str,
    title: str,
    configs: Sequence[str],
    series: Sequence[Series],
    ylabel: str,
    line: float | None = None,
) -> None:
    """``series`` side by side over ``configs``, each bar with its interval (and a dotted level at
    ``line``), written as bench/out/``name``.png."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for index, (label, means, intervals) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * width
        errors = np.array([[m - low, high - m] for m, (low, high) in zip(means, intervals, strict=True)]).T
        axis.bar(np.arange(len(configs)) + offset, means, width=width, yerr=errors, capsize=3, label=label)
    if line is not None:
        axis.axhline(line, color="grey", linestyle=":", linewidth=1)
    axis.set_xticks(np.arange(len(configs)), configs, rotation=25, ha="right")
    axis.set_ylim(0, 1)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend()
    axis.grid(axis="y", alpha=0.3)
    save_figure(figure, plot_path(name))


def plot(summary: dict[str, dict[str, Any]], title: str) -> None:
    names = list(summary)
    series = [
        (metric, [summary[n][metric] for n in names], [summary[n][f"{metric}_ci"] for n in names])
        for metric in ("accuracy", "f1")
    ]
    bar_chart("quality", title, names, series, "fraction (95 % bootstrap interval)")


def _rounded(value: Any) -> Any:
    """``value`` (a figure, an interval or a mapping of them) to three decimals."""
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return round(value, 3) if isinstance(value, float) else value


def headline(
    facts: dict[str, Any],
    summary: dict[str, dict[str, Any]],
    embedders: dict[str, dict[str, Any]] | None = None,
    concurrent_vs_alone: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The last line: the issue's shape, every configuration's accuracy and F1, deltas with CIs,
    the embedders compared and how concurrent answers agreed with answers computed alone."""
    configs: dict[str, dict[str, Any]] = {}
    for name, entry in summary.items():
        row: dict[str, Any] = {metric: round(entry[metric], 3) for metric in METRICS}
        for key in ("delta_vs_serial_ci", "delta_vs_full_history_ci"):
            if key in entry:
                row[key] = [round(v, 3) for v in entry[key]]
        if name == "speculation":
            row["adopted"] = round(entry["adopted"], 3)
            identical = entry["identical_to_serial"]
            row["identical_to_serial"] = None if identical is None else round(identical, 3)
        configs[name] = row
    return {
        "model": facts["model"],
        "questions": facts["questions"],
        "conversations": facts["conversations"],
        "configs": configs,
        "embedders": _rounded(embedders or {}),
        "concurrent_vs_alone": concurrent_vs_alone,
    }


def interval(interval: Sequence[float]) -> str:
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]"
