"""bench.ordering's figure: the independent score of every policy, and the batch index's time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.common import plot_path, save_figure
from bench.ordering.runs import BENCH_POLICIES


def plot(report: dict[str, Any]) -> Path:
    import matplotlib.pyplot as plt

    traces = list(report["traces"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.8 / len(BENCH_POLICIES)
    for ax, scored in zip(axes[:2], ("unlimited", "lru"), strict=True):
        for j, policy in enumerate(BENCH_POLICIES):
            values = [report["traces"][t][policy]["lru10"]["independent"][scored] for t in traces]
            ax.bar(np.arange(len(traces)) + j * width, values, width, label=policy)
        ax.set_xticks(np.arange(len(traces)) + 0.4 - width / 2, traces)
        ax.set_ylabel("document slots whose prefix was served before")
        cache = "unlimited cache" if scored == "unlimited" else "LRU of 10 % of slots"
        ax.set_title(f"independent score, {cache}")
    axes[0].legend(fontsize=8, ncol=2)
    for name in ("zipf", "topics"):
        sizes = [s for s in report["batch_index_time"] if s["trace"] == name]
        axes[2].plot([s["n"] for s in sizes], [s["cpu_seconds"] for s in sizes], marker="o", label=name)
    axes[2].legend()
    axes[2].set_xlabel("requests (k = 10)")
    axes[2].set_ylabel("CPU seconds")
    axes[2].set_title("batch index (cluster + order + schedule)")
    path = save_figure(fig, plot_path("ordering"), dpi=110)
    return path
