"""MiniLM's build throughput under its two schedules, on the same passages, interleaved.

``pass per core`` (the default) runs as many batches at once as the process has cores, each pass
on one torch thread; ``pass on all cores`` runs one batch after another, each pass split over all
the cores (the schedule it replaced). The passages go in windows of one batch per core; each
window is embedded by both schedules, the first alternating, so that both see the same load on a
shared machine. Reported: documents per second of each, the speed-up (the other schedule's time
over the default's, with a 95 % bootstrap interval resampling windows) and the median of the
per-window ratios, and the smallest cosine between the two schedules' vectors of a passage. No
search runs here, so no regime r applies.

Rerun: ``python -m bench.retrieval.embedding --corpus data/corpus/passages.jsonl [--quick]``
(``bench/out/retrieval_embedding.json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.common import bootstrap_ratio_ci, print_summary, save_figure, write_report
from specrag.pipeline.store.document_writes import indexed_text
from specrag.retrieval.corpus import load_passages
from specrag.retrieval.embedders.batching import length_sorted_batches
from specrag.retrieval.embedders.minilm_embedder import BATCH, MiniLMEmbedder, minilm_weights

QUICK_PASSAGES = 512
SCHEDULES = ("pass per core", "pass on all cores")


def windows(texts: list[str]) -> list[list[str]]:
    """The texts in length order (as a build takes them), cut into one batch per core a window."""
    size = BATCH * len(os.sched_getaffinity(0))
    order = [row for rows in length_sorted_batches(texts, size) for row in rows]
    return [[texts[row] for row in order[start : start + size]] for start in range(0, len(order), size)]


def measure(texts: list[str]) -> dict[str, Any]:
    weights = minilm_weights()
    embedders = {
        SCHEDULES[0]: MiniLMEmbedder(weights),
        SCHEDULES[1]: MiniLMEmbedder(weights, pass_per_core=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    min_cosine = 1.0
    for number, window in enumerate(windows(texts)):
        vectors = {}
        for name in SCHEDULES if number % 2 == 0 else SCHEDULES[::-1]:
            start = time.perf_counter()
            vectors[name] = embedders[name].embed(window)
            seconds[name].append(time.perf_counter() - start)
        min_cosine = min(min_cosine, float(np.einsum("ij,ij->i", *vectors.values()).min()))
    default, former = (np.array(seconds[name]) for name in SCHEDULES)
    rng = np.random.default_rng(0)
    return {
        "passages": len(texts),
        "windows": len(default),
        "precision": weights.precision,
        "docs_per_s": {name: round(len(texts) / sum(seconds[name]), 2) for name in SCHEDULES},
        "speedup": round(float(former.sum() / default.sum()), 3),
        "speedup_ci": [round(end, 3) for end in bootstrap_ratio_ci(former, default, rng)],
        "speedup_median_window": round(float(np.median(former / default)), 3),
        "min_cosine": round(min_cosine, 6),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 3))
    rates = [result["docs_per_s"][name] for name in SCHEDULES]
    axis.barh(SCHEDULES, rates, color=["tab:blue", "tab:gray"])
    axis.set_xlabel("documents embedded per second (MiniLM, build)")
    axis.set_title(f"speed-up {result['speedup']}x, 95 % interval {result['speedup_ci']}")
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="JSONL corpus: {id, title, text} a line")
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_PASSAGES} passages")
    parser.add_argument(
        "--name", default="retrieval_embedding", help="basename of the JSON and PNG in bench/out/"
    )
    args = parser.parse_args()
    passages = load_passages(args.corpus)
    if args.quick:
        passages = passages[:QUICK_PASSAGES]
    result = measure([indexed_text(passage) for passage in passages])
    write_report(args.name, result, lambda path: plot(result, path))
    print_summary(result, rerun=f"bench.retrieval.embedding --corpus {args.corpus}" + " --quick" * args.quick)


if __name__ == "__main__":
    main()
