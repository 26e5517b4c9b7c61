"""bench.pipeline's output: the lines printed per point, the figure, and the last-line summary.

:func:`headline` is the JSON summary the command prints last, which docs/pipelining.md quotes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import plot_path
from bench.pipeline.analysis import PHASES
from specrag.retrieval.search.stages import DEFAULT_SCHEDULE


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
        **({"pgvector": extra_point(result["pgvector"])} if result.get("pgvector") else {}),
        "index": result["facts"]["index"],
        "schedule": DEFAULT_SCHEDULE,
        "stages": result["facts"]["stages"],
        "pinning": result["facts"]["pinning"],
    }


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


def phase_medians(point: dict[str, Any], name: str) -> dict[str, float | None]:
    """``name``'s median of each phase of the answers' first token at one point."""
    phases = point["phases"][name]
    return {phase: None if phases[phase] is None else phases[phase]["median"] for phase in PHASES}
