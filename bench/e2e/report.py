"""Figures from the per-request timelines: summaries, paired confidence intervals, plots, the
terminal table and the last line."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import bootstrap_ratio_ci, plot_path, save_figure
from bench.e2e.runner import RunResult
from specrag.controller.modes import MODE_NAMES

BLOCK_REQUESTS = 4
"""Requests of a trace resampled together: neighbours in one queueing trace are not independent
(a slow request delays the next ones), so the bootstrap draws runs of consecutive requests."""


def answered(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "error" not in r and r.get("ttft_ms") is not None]


def _mean(ok: Sequence[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in ok if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def _basis(ok: Sequence[dict[str, Any]]) -> str | None:
    """The one basis of every non-overlap figure of the run, or "mixed"."""
    bases = {r.get("non_overlapped_basis") for r in ok}
    return bases.pop() if len(bases) == 1 else ("mixed" if bases else None)


def tree_agreement(ok: Sequence[dict[str, Any]]) -> float:
    """Share of answers whose request the tree predicted the engine's prefix hit for exactly.

    The prediction is made when the request is submitted; the engine answers when it schedules
    it. Requests submitted while another was being prefilled may find more cached by then,
    which is no fault of the mirror: the caller reports the share without them beside this one.
    """
    if not ok:
        return float("nan")
    return float(np.mean([r["predicted_cached_tokens"] == r["cached_prompt_tokens"] for r in ok]))


def first_request_cold(run: RunResult) -> bool | None:
    """Whether the run's first request found nothing cached but the system prompt (what warm-up
    or its own speculation put there): the reset held until the run began.

    None when it cannot be judged: the request failed, or a speculation of its own was dropped
    (its documents may be cached by then).
    """
    first = next((r for r in run.records if r.get("i") == 0), None)
    if first is None or "error" in first or first.get("aborted_speculations", 0) > 0:
        return None
    return bool(first["cached_prompt_tokens"] <= run.system_prompt_tokens)


def summarize(run: RunResult, oracle_ms: dict[int, float], slo_ms: float) -> dict[str, Any]:
    """The issue's metrics for one configuration's run."""
    ok = answered(run.records)
    ttft = np.array([r["ttft_ms"] for r in ok]) if ok else np.array([np.nan])
    e2e = np.array([r["e2e_ms"] for r in ok]) if ok else np.array([np.nan])
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    paired = [(oracle_ms[r["i"]], r["ttft_ms"]) for r in ok if r["i"] in oracle_ms]
    return {
        "config": run.configuration.name,
        "mode": run.configuration.mode,
        "group": run.configuration.group,
        "search_ratio": run.configuration.search_ratio,
        "nprobe": run.nprobe,
        "overrides": run.configuration.overrides,
        "requests": len(run.records),
        "errors": len(run.records) - len(ok),
        "error_kinds": dict(Counter(r["error"].split(":")[0] for r in run.records if "error" in r)),
        "reset_confirmed": run.reset_confirmed,
        "first_request_cold": first_request_cold(run),
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "e2e_mean_ms": float(np.mean(e2e)),
        "e2e_p99_ms": float(np.percentile(e2e, 99)),
        "embed_ms_mean": _mean(ok, "embed_ms"),
        "retrieval_ms_mean": _mean(ok, "retrieval_ms"),
        "non_overlapped_retrieval_ms_mean": _mean(ok, "non_overlapped_retrieval_ms"),
        "non_overlapped_basis": _basis(ok),
        "non_overlapped_retrieval_submitted_ms_mean": _mean(ok, "non_overlapped_retrieval_submitted_ms"),
        "docs_per_prompt_mean": float(np.mean([len(r["documents"]) for r in ok])) if ok else float("nan"),
        "kv_mirror": None if run.mirror is None else asdict(run.mirror),
        "tree_agreement": tree_agreement(ok),
        "tree_agreement_without_prefill_beside": tree_agreement(
            [r for r in ok if not r.get("predicted_beside_prefill")]
        ),
        "cached_token_ratio": sum(r["cached_prompt_tokens"] for r in ok) / prompt_tokens
        if prompt_tokens
        else 0.0,
        "wasted_spec_prefill_tokens": int(sum(r["wasted_spec_prefill_tokens"] for r in ok)),
        "speculations": int(sum(r["speculations"] for r in ok)),
        "adopted_fraction": float(np.mean([r["adopted"] for r in ok])) if ok else 0.0,
        "warmups": int(sum(r["warmed"] for r in ok)),
        "controller_ms_mean": float(np.mean([r["controller_ms"] for r in ok])) if ok else float("nan"),
        "goodput_rps_at_slo": sum(r["ttft_ms"] <= slo_ms for r in ok) / run.wall_s,
        "fraction_of_oracle_ttft": (
            float(np.mean([o for o, _ in paired]) / np.mean([t for _, t in paired])) if paired else None
        ),
        "wall_s": run.wall_s,
    }


def paired_ratio_ci(
    baseline: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], seed: int = 0
) -> tuple[float, float, float]:
    """Mean TTFT of ``other`` over ``baseline`` on the same requests, with a 95 % block-bootstrap
    interval.

    A record's ``i`` is ``(trace, index)``; the bootstrap resamples blocks of
    :data:`BLOCK_REQUESTS` consecutive requests of one trace (each trace a repetition), never
    single requests of one queueing trace. Requests that failed in either run are not paired:
    their count is reported beside the ratio by the caller.
    """
    base = {r["i"]: r["ttft_ms"] for r in answered(baseline)}
    blocks: dict[tuple[Any, int], list[tuple[float, float]]] = {}
    for r in answered(other):
        if r["i"] in base:
            trace, index = r["i"]
            blocks.setdefault((trace, index // BLOCK_REQUESTS), []).append((base[r["i"]], r["ttft_ms"]))
    if not blocks:
        return float("nan"), float("nan"), float("nan")
    sums = np.array([np.sum(pairs, axis=0) for pairs in blocks.values()])  # per block: (base, other)
    low, high = bootstrap_ratio_ci(sums[:, 1], sums[:, 0], np.random.default_rng(seed))
    return float(sums[:, 1].sum() / sums[:, 0].sum()), low, high


def plot_ttft_cdf(runs: Sequence[RunResult], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        values = np.sort([r["ttft_ms"] for r in answered(run.records)])
        if len(values):
            axis.step(
                values,
                np.arange(1, len(values) + 1) / len(values),
                where="post",
                label=run.configuration.name,
            )
    axis.set_xlabel("time to first token (ms)")
    axis.set_ylabel("fraction of requests")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(figure, path)


def plot_ratio_sweep(
    rows: Sequence[dict[str, Any]], search_ms: dict[float, float], cold_prefill_ms: float, path: Path
) -> None:
    """TTFT and non-overlapped search time against the searched fraction, serial vs all."""
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in sorted({row["mode"] for row in rows}):
        chosen = sorted((row for row in rows if row["mode"] == mode), key=lambda row: row["search_ratio"])
        ratios = [row["search_ratio"] * 100 for row in chosen]
        left.plot(ratios, [row["ttft_mean_ms"] for row in chosen], marker="o", label=f"{mode}: TTFT mean")
        right.plot(
            ratios, [row["non_overlapped_retrieval_ms_mean"] for row in chosen], marker="o", label=mode
        )
    ratios = sorted(search_ms)
    left.plot(
        [r * 100 for r in ratios],
        [search_ms[r] for r in ratios],
        ls="--",
        color="gray",
        label="one search alone",
    )
    left.axhline(cold_prefill_ms, ls=":", color="black", label="cold prefill of a typical prompt")
    left.set_xlabel("vector search ratio (% of IVF lists probed)")
    left.set_ylabel("ms")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.set_xlabel("vector search ratio (%)")
    right.set_ylabel("non-overlapped retrieval (ms, mean)")
    right.legend()
    right.grid(alpha=0.3)
    save_figure(figure, path)


_MARKERS = {"stage": ("|", "tab:blue"), "spec_submit": ("^", "tab:green"), "spec_abort": ("x", "tab:red"),
            "adopt": ("*", "gold"), "final_submit": ("s", "tab:purple"), "warmup_start": ("D", "tab:orange"),
            "first_token": ("o", "black")}  # fmt: skip


def plot_timeline_strip(records: Sequence[dict[str, Any]], path: Path, title: str, count: int = 8) -> None:
    """A few requests on one time axis: search span, stages, speculations, aborts, first token."""
    import matplotlib.pyplot as plt

    chosen = [r for r in answered(records) if r.get("events")][:count]
    figure, axis = plt.subplots(figsize=(10, 0.6 * len(chosen) + 1.5))
    seen: set[str] = set()
    for row, record in enumerate(chosen):
        base = 0.0  # each request on its own clock: spans are ms, arrivals seconds apart
        axis.barh(row, record["ttft_ms"], left=base, height=0.3, color="lightgray")
        for event in record["events"]:
            if event["kind"] not in _MARKERS:
                continue
            marker, color = _MARKERS[event["kind"]]
            label = event["kind"] if event["kind"] not in seen else None
            seen.add(event["kind"])
            axis.scatter(base + event["t_ms"], row, marker=marker, color=color, s=60, zorder=3, label=label)
    axis.set_yticks(range(len(chosen)), [f"req {r['i']}" for r in chosen])
    axis.set_xlabel("ms since the request's arrival (gray bar: arrival to first token)")
    axis.set_title(title)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    save_figure(figure, path)


def plots(
    results: dict[tuple[int, str], RunResult],
    summaries: dict[str, Any],
    search_ms: dict[float, float],
    cold_ms: float,
) -> None:
    """The three figures: TTFT CDFs, the ratio sweep and the timeline strip of ``all``."""
    main_runs = [results[(0, mode)] for mode in MODE_NAMES if (0, mode) in results]
    plot_ttft_cdf(main_runs, plot_path("e2e_ttft_cdf"), "TTFT by configuration (seed 0)")
    sweep = [
        s
        for key, s in summaries.items()
        if key.endswith("@seed0") and (s["group"] == "ratio" or s["config"] in ("serial", "all"))
    ]
    plot_ratio_sweep(sweep, search_ms, cold_ms, plot_path("e2e_ratio_sweep"))
    plot_timeline_strip(
        results[(0, "all")].records, plot_path("e2e_timelines"), "Requests of the 'all' configuration"
    )


def print_table(result: dict[str, Any]) -> None:
    columns = (
        "TTFT mean",
        "p50",
        "p99",
        "non-ovl",
        "cached",
        "wasted",
        "spec",
        "adopt",
        "oracle",
        "agree",
        "err",
    )
    header = f"{'configuration':<22}" + "".join(f"{c:>10}" for c in columns)
    print("\n" + header)
    for key, s in result["summaries"].items():
        oracle = "" if s["fraction_of_oracle_ttft"] is None else f"{s['fraction_of_oracle_ttft']:.2f}"
        cells = (
            f"{s['ttft_mean_ms']:.0f}",
            f"{s['ttft_p50_ms']:.0f}",
            f"{s['ttft_p99_ms']:.0f}",
            f"{s['non_overlapped_retrieval_ms_mean']:.1f}",
            f"{s['cached_token_ratio']:.2f}",
            str(s["wasted_spec_prefill_tokens"]),
            str(s["speculations"]),
            f"{s['adopted_fraction']:.2f}",
            oracle,
            f"{s['tree_agreement']:.2f}",
            str(s["errors"]),
        )
        print(f"{key:<22}" + "".join(f"{c:>10}" for c in cells))
    print("\nmean TTFT vs serial (95 % CI):")
    for mode, h in result["headline"].items():
        print(
            f"  {mode:<18} {h['ttft_mean_ratio_vs_serial']:.3f}  [{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}]"
            f"  p99 {h['ttft_p99_ratio_vs_serial_seed0']:.3f}x"
            f"  ({h['unpaired_errors']} failed requests left out)"
        )
    facts = result["facts"]
    print(
        f"\nengine on core(s) {facts['engine_cpus']}, service and search on core(s) {facts['search_cpus']}; "
        f"search ms by ratio {facts['search_ms_by_ratio']}; cold prefill {facts['cold_prefill_ms']:.0f} ms"
    )


LAST_LINE_KEYS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "embed_ms_mean",
    "non_overlapped_retrieval_ms_mean",
    "non_overlapped_basis",
    "non_overlapped_retrieval_submitted_ms_mean",
    "cached_token_ratio",
    "wasted_spec_prefill_tokens",
    "docs_per_prompt_mean",
    "tree_agreement",
    "tree_agreement_without_prefill_beside",
    "errors",
    "reset_confirmed",
    "first_request_cold",
)


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def summary_line(result: dict[str, Any]) -> dict[str, Any]:
    """The last line's figures: each main configuration's seed-0 summary, the headline, the machine."""
    last: dict[str, Any] = {
        mode: {key: _rounded(result["summaries"][f"{mode}@seed0"][key]) for key in LAST_LINE_KEYS}
        for mode in MODE_NAMES
        if f"{mode}@seed0" in result["summaries"]
    }
    facts = result["facts"]
    # The figures: each configuration's mean TTFT over serial's with its 95 % interval.
    last["headline"] = {
        mode: {
            key: [_rounded(v) for v in value] if isinstance(value, list) else _rounded(value)
            for key, value in figures.items()
        }
        for mode, figures in result["headline"].items()
    }
    last["machine"] = {
        "engine_cpus": facts["engine_cpus"],
        "search_cpus": facts["search_cpus"],
        "model": facts["model"],
        "index": facts["index"],
        "cpus": facts["cpus"],
    }
    return last
