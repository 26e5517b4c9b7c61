"""bench.updates' report: the figure and the figures of the last line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.common import save_figure


def plot(result: dict[str, Any], path: Path) -> None:
    figure, (latency, recalls) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("idle", "updating"):
        values = np.sort(result[f"{name}_ms"])
        latency.plot(
            values,
            np.linspace(0, 1, len(values)),
            label=f"{name} (p99 {result['query_ms'][name]['p99']:.1f} ms)",
        )
    latency.set_xlabel("staged search, ms")
    latency.set_ylabel("share of queries")
    latency.set_title(f"search latency, idle vs {result['update_rate_achieved']:.0f} updates/s")
    latency.legend()
    names = [
        "fresh\nbuild",
        "live, 20 %\nreplaced",
        "drifted,\nold centroids",
        "drifted,\nretrained",
        "drifted,\nfresh build",
    ]
    recall_values = [
        result["recall_at5_fresh_build"],
        result["recall_at5_after_updates"],
        result["recall_at5_drifted_build_centroids"],
        result["recall_at5_drifted_retrained"],
        result["recall_at5_drifted_fresh_build"],
    ]
    recalls.bar(names, recall_values, color=["grey", "tab:blue", "tab:red", "tab:green", "grey"])
    recalls.set_ylim(min(recall_values) - 0.05, 1.0)
    recalls.set_title(f"recall@5, {result['passages']:,} passages")
    save_figure(figure, path)


def history_summary(history: dict[str, Any]) -> dict[str, Any]:
    """The history figures of the summary line: after the first batch, then after all of them."""
    return {
        f"history_{figure}_{when}": round(history[when][figure], 3)
        for when in ("after_first", "after_all")
        for figure in ("log_bytes", "log_bytes_after_start", "start_up_s", "rss_mb")
    }


def summary_line(result: dict[str, Any], json_path: Path, png_path: Path) -> dict[str, Any]:
    """The last line's figures, rounded, and where the report was written."""
    idle, updating = result["query_ms"]["idle"], result["query_ms"]["updating"]
    return {
        "passages": result["passages"],
        "recall_at5_fresh_build": round(result["recall_at5_fresh_build"], 4),
        "recall_at5_after_updates": round(result["recall_at5_after_updates"], 4),
        "query_p50_ms_idle": round(idle["p50"], 2),
        "query_p99_ms_idle": round(idle["p99"], 2),
        "query_p50_ms_updating": round(updating["p50"], 2),
        "query_p99_ms_updating": round(updating["p99"], 2),
        "query_p99_ratio_updating_over_idle": round(updating["p99"] / idle["p99"], 3),
        "update_rate_achieved": round(result["update_rate_achieved"], 1),
        "updates_per_s_one_at_a_time": round(result["updates_per_s_one_at_a_time"], 1),
        "updates_per_s_batched": round(result["updates_per_s_batched"], 1),
        "compaction_s": round(result["compaction_s"], 3),
        "drift_same_distribution": round(result["drift_same_distribution"], 3),
        "drift": round(result["drift"], 3),
        "recall_at5_drifted_build_centroids": round(result["recall_at5_drifted_build_centroids"], 4),
        "recall_at5_drifted_retrained": round(result["recall_at5_drifted_retrained"], 4),
        "recall_at5_drifted_fresh_build": round(result["recall_at5_drifted_fresh_build"], 4),
        "retraining_s": round(result["retraining_s"], 2),
        **history_summary(result["history"]),
        "report": [str(json_path), str(png_path)],
    }
