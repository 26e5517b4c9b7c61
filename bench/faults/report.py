"""bench.faults' verdicts and report: which checks held, the JSON, the figure, the table, the last line."""

from __future__ import annotations

import json
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import machine, plot_path, save_figure, write_json
from bench.faults.inputs import BAD_REQUESTS
from bench.faults.outcomes import CLIENT_LEFT, FIRST_TOKEN_TIMEOUT_S, Run

ENGINE_ERROR_STATUSES = (502, 503, 504)
"""The documented engine errors: 502 the engine failed, 503 it is recovering, 504 no first token."""


FAULTS = ("kill", "hang")
OVERLOAD_LIMITS = ("max_queue", "max_queries", "max_queries_per_client")
# The settles recorded beside the last one (run.leaks itself).
_SETTLED = ("after_disconnects", "after_soak")


def is_server_error(status: int) -> bool:
    """A 5xx that is not a documented engine error: the service itself failed."""
    return 500 <= status < 600 and status not in ENGINE_ERROR_STATUSES


def summarize(run: Run, leftover_processes: int, failure: str | None = None) -> dict[str, Any]:
    """What the run measured, which checks held, and ``failure`` (what stopped it, or None).

    Everything is read as measured so far, so that a run that failed half way still says what
    it saw; a check whose scenario never ran does not hold.
    """
    statuses = Counter(outcome.status for outcome in run.outcomes)
    fault_errors = [o for o in run.outcomes if o.scenario in ("kill", "hang") and o.status != 200]
    soaked = [o for o in run.outcomes if o.scenario.startswith("soak")]
    settled = [leaks for leaks in (run.leaks, *(run.leaks.get(when) for when in _SETTLED)) if leaks]
    leaked = sum(leaks["leaked"] for leaks in settled)
    server_errors = sum(count for status, count in statuses.items() if is_server_error(status))
    bad_wrong = sum(1 for row in run.bad_inputs if not row["ok"])
    checks = {
        "every_bad_input_got_its_4xx": len(run.bad_inputs) == len(BAD_REQUESTS) and bad_wrong == 0,
        "overload_got_429_with_retry_after": len(run.overload) == len(OVERLOAD_LIMITS)
        and all(report["rejected_without_retry_after"] == 0 for report in run.overload.values()),
        "no_server_errors_5xx": server_errors == 0,
        "no_crashes": run.health_failures == 0,
        "no_leaks": len(settled) == 1 + len(_SETTLED) and leaked == 0,
        "engine_recovered_from_every_fault": sorted(run.recoveries) == sorted(FAULTS),
        "no_leftover_engine_processes": leftover_processes == 0,
    }
    return {
        "ok": failure is None and all(checks.values()),
        "failure": failure,
        "checks": checks,
        "requests": len(run.outcomes),
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
        "faults_injected": len(run.faults),
        "bad_inputs_tried": len(run.bad_inputs),
        "bad_inputs_wrong_status": bad_wrong,
        "server_errors_5xx": server_errors,
        "engine_errors_returned": sum(statuses[status] for status in ENGINE_ERROR_STATUSES),
        "connection_errors": statuses[0],
        "overloaded_429": statuses[429],
        "max_fault_error_latency_s": max((o.latency_s for o in fault_errors), default=0.0),
        "crashes": run.health_failures,
        "leaked_engine_requests": leaked,
        "soak_requests": len(soaked),
        "soak_disconnects": sum(o.status == CLIENT_LEFT for o in soaked),
        "soak_statuses": {str(k): v for k, v in sorted(Counter(o.status for o in soaked).items())},
        "soak_leaked": run.leaks.get("after_soak", {}).get("leaked"),
        "max_recovery_s": max(run.recoveries.values(), default=None),
        "recovery_s": run.recoveries,
        "admitted_p99_s": {label: r["admitted_p99_s"] for label, r in run.overload.items()},
        "leftover_engine_processes": leftover_processes,
    }


def plot(run: Run, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (timeline, bars) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    colours = {
        200: "tab:green",
        429: "tab:orange",
        502: "tab:red",
        503: "tab:purple",
        504: "tab:brown",
        0: "black",
    }
    for status in sorted({o.status for o in run.outcomes}):
        points = [o for o in run.outcomes if o.status == status]
        label = "client 4xx" if 400 <= status < 429 else f"{status or 'connection error'}"
        timeline.scatter(
            [o.started_s for o in points],
            [o.latency_s for o in points],
            s=10,
            c=colours.get(status, "tab:gray"),
            label=label,
        )
    for fault in run.faults:
        timeline.axvline(fault["at_s"], color="red", linestyle="--")
        timeline.annotate(fault["scenario"], (fault["at_s"], 0), rotation=90, color="red")
        if "recovered_at_s" in fault:
            timeline.axvspan(fault["at_s"], fault["recovered_at_s"], color="red", alpha=0.08)
    timeline.set(xlabel="time since start (s)", ylabel="request latency (s)", title="request outcomes")
    timeline.legend(fontsize=8)
    bars.bar(list(run.recoveries), list(run.recoveries.values()), color="tab:red")
    bars.set(ylabel="seconds", title="recovery: fault → /health 200 + a query")
    save_figure(figure, path)


def print_table(summary: dict[str, Any], run: Run) -> None:
    print(f"\n{'scenario':<28}{'requests':>9}  statuses")
    for scenario in dict.fromkeys(o.scenario for o in run.outcomes):
        rows = [o for o in run.outcomes if o.scenario == scenario]
        statuses = dict(sorted(Counter(o.status for o in rows).items()))
        print(f"{scenario:<28}{len(rows):>9}  {statuses}")
    for name, seconds in run.recoveries.items():
        print(f"recovery after {name}: {seconds:.1f} s")
    for label, report in run.overload.items():
        print(f"overload {label}: {report['statuses']} admitted p99 {report['admitted_p99_s']}")
    print(f"leaks: {run.leaks}")
    print(
        f"{'5xx (not engine errors)':<12}{summary['server_errors_5xx']}   crashes {summary['crashes']}   "
        f"leaked {summary['leaked_engine_requests']}   bad inputs wrong {summary['bad_inputs_wrong_status']}"
    )
    failed = [name for name, held in summary["checks"].items() if not held]
    print(f"checks not held: {', '.join(failed)}" if failed else "every check held")
    if summary["failure"]:
        print(f"the run failed in {summary['failure']}")


def report(run: Run, summary: dict[str, Any], quick: bool) -> bool:
    """Write the JSON and the figure, print the table and, last, the summary line; whether the run
    held. A report that cannot be written is a failure too, but the summary line is printed."""
    try:
        write_json(
            "faults",
            {
                "summary": summary,
                "machine": machine(),
                "quick": quick,
                "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
                "faults": run.faults,
                "overload": run.overload,
                "bad_inputs": run.bad_inputs,
                "leaks": run.leaks,
                "outcomes": [asdict(o) for o in run.outcomes],
            },
        )
        plot(run, plot_path("faults"))
        print_table(summary, run)
    except Exception as error:
        traceback.print_exc()
        summary["failure"] = summary["failure"] or f"writing the report: {type(error).__name__}: {error}"
        summary["ok"] = False
    print(json.dumps(summary, sort_keys=True), flush=True)
    return bool(summary["ok"])
