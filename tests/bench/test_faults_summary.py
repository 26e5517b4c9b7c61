"""bench.faults' verdicts: which statuses are server errors, what counts as left behind."""

from __future__ import annotations

from bench.faults import CLIENT_LEFT, Outcome, Run, summarize


def _run(statuses: list[int], leaks: dict[str, int]) -> Run:
    run = Run()
    run.outcomes = [Outcome("load", 0.0, 0.1, status) for status in statuses]
    run.outcomes += [Outcome("soak", 0.0, 0.1, 200), Outcome("soak disconnect", 0.0, 0.1, CLIENT_LEFT)]
    nothing = {"leaked": 0}
    run.leaks = {**leaks, "after_disconnects": nothing, "after_soak": nothing}
    return run


def test_every_5xx_but_the_documented_engine_errors_is_a_server_error() -> None:
    summary = summarize(_run([200, 500, 501, 502, 503, 504, 507], {"leaked": 0}), 0)
    assert summary["server_errors_5xx"] == 3
    assert summary["engine_errors_returned"] == 3


def test_leaks_and_the_soak_are_reported() -> None:
    summary = summarize(_run([200], {"leaked": 2}), 0)
    assert summary["leaked_engine_requests"] == 2
    assert summary["soak_requests"] == 2 and summary["soak_disconnects"] == 1
