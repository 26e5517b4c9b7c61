"""bench.faults' verdicts: which statuses are server errors, what counts as left behind, and that
a run always ends with its JSON summary line and an exit status saying whether every check held."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import bench.faults.__main__ as faults
import bench.faults.report as faults_report
from bench.faults.inputs import BAD_REQUESTS
from bench.faults.outcomes import CLIENT_LEFT, Outcome, Run
from bench.faults.report import FAULTS, OVERLOAD_LIMITS, summarize


def _run(statuses: list[int], leaks: dict[str, int]) -> Run:
    """A run in which every scenario ran and every check held but for ``statuses`` and ``leaks``."""
    run = Run()
    run.outcomes = [Outcome("load", 0.0, 0.1, status) for status in statuses]
    run.outcomes += [Outcome("soak", 0.0, 0.1, 200), Outcome("soak disconnect", 0.0, 0.1, CLIENT_LEFT)]
    nothing = {"leaked": 0}
    run.leaks = {**leaks, "after_disconnects": nothing, "after_soak": nothing}
    run.bad_inputs = [{"ok": True} for _ in BAD_REQUESTS]
    held = {"statuses": {200: 3, 429: 9}, "rejected_without_retry_after": 0, "admitted_p99_s": 1.0}
    run.overload = dict.fromkeys(OVERLOAD_LIMITS, held)
    run.recoveries = dict.fromkeys(FAULTS, 10.0)
    return run


def test_every_5xx_but_the_documented_engine_errors_is_a_server_error() -> None:
    summary = summarize(_run([200, 500, 501, 502, 503, 504, 507], {"leaked": 0}), 0)
    assert summary["server_errors_5xx"] == 3
    assert summary["engine_errors_returned"] == 3
    assert summary["checks"]["no_server_errors_5xx"] is False and summary["ok"] is False


def test_leaks_and_the_soak_are_reported() -> None:
    summary = summarize(_run([200], {"leaked": 2}), 0)
    assert summary["leaked_engine_requests"] == 2
    assert summary["soak_requests"] == 2 and summary["soak_disconnects"] == 1
    assert summary["checks"]["no_leaks"] is False and summary["ok"] is False


def test_a_run_where_every_check_held_is_ok() -> None:
    summary = summarize(_run([200, 502, 503, 504, 429], {"leaked": 0}), 0)
    assert summary["ok"] is True and summary["failure"] is None and all(summary["checks"].values())
    assert summarize(_run([200], {"leaked": 0}), 1)["ok"] is False  # an engine process left over


def test_a_run_stopped_half_way_is_summarised_with_its_failure() -> None:
    run = Run()
    run.outcomes = [Outcome("kill", 0.0, 0.1, 502)]
    run.leaks = {"leaked": 0}  # only the first settle happened
    summary = summarize(run, 0, "(a) kill the engine core: RuntimeError: no recovery")
    assert summary["ok"] is False and summary["failure"].startswith("(a) kill the engine core")
    assert summary["checks"]["no_leaks"] is False  # not measured after every scenario: not held
    assert summary["checks"]["engine_recovered_from_every_fault"] is False


@pytest.mark.parametrize("fails", [True, False])
def test_main_prints_the_summary_last_and_exits_by_the_checks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, fails: bool
) -> None:
    """A run whose engine does not come back (or that holds) still ends with its JSON line."""

    async def run_all(args: argparse.Namespace, run: Run, stopped: set[int]) -> None:
        ran = _run([200], {"leaked": 0})
        run.outcomes, run.leaks, run.bad_inputs = ran.outcomes, ran.leaks, ran.bad_inputs
        run.overload, run.recoveries = ran.overload, ran.recoveries
        if fails:
            run.begin("(a) kill the engine core")
            raise RuntimeError("the service did not recover within 240 s")

    written: dict[str, Any] = {}
    cleaned: list[set[int]] = []
    monkeypatch.setattr(faults, "run_all", run_all)

    # The clean-up kills every engine core this process started: here that is the test session's
    # shared engine, which the rest of the suite still needs. That it runs is what is checked.
    def kill_leftover(pids: set[int]) -> int:
        cleaned.append(pids)
        return 0

    monkeypatch.setattr(faults, "kill_leftover", kill_leftover)
    monkeypatch.setattr(faults_report, "write_json", lambda name, data: written.update(data))
    monkeypatch.setattr(faults_report, "plot_path", lambda name: tmp_path / f"{name}.png")
    monkeypatch.setattr("sys.argv", ["bench.faults", "--quick"])
    with pytest.raises(SystemExit) as exited:
        faults.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert exited.value.code == (1 if fails else 0) and summary["ok"] is not fails
    assert summary == written["summary"]
    if fails:
        expected = "(a) kill the engine core: RuntimeError: the service did not recover within 240 s"
        assert summary["failure"] == expected
    assert (tmp_path / "faults.png").is_file()
    assert cleaned == [set()]  # the clean-up ran, even after the failure
