"""bench.capacity: the capacity rule, and a tiny run through both fronts in front of one stand-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.capacity.__main__ import run
from bench.capacity.report import ELSEWHERE, capacity_of, summary
from bench.common import OUT_DIR


def point(rate: float, p99: float | None, failed: int = 0) -> dict[str, Any]:
    return {
        "offered_per_s": rate,
        "answers_per_s": rate * 0.99,
        "failed": failed,
        "unmatched_answers": 0,
        "added_ttft_ms": {"p50": p99, "p99": p99},
    }


def test_the_capacity_is_the_highest_rate_held_with_nothing_failed() -> None:
    points = [point(10, 3.0), point(20, 9.5), point(40, 8.0, failed=1), point(80, 30.0)]
    capacity, at = capacity_of(points)
    assert capacity == pytest.approx(19.8) and at is points[1]
    assert capacity_of([point(10, 11.0), point(20, None)]) == (0.0, None)


def test_the_embedding_elsewhere_runs_have_headline_keys_of_their_own() -> None:
    def run_of(rates: list[tuple[float, float]]) -> list[dict[str, Any]]:
        return [
            point(rate, p99)
            | {
                "predictions": 0,
                "predicted_equals_delivered": None,
                "mirrors": [],
                "cpu_ms_per_answer": {"total": rate},
            }
            for rate, p99 in rates
        ]

    runs = {
        "specrag-4": run_of([(10, 12.0)]),
        "thin-4": run_of([(10, 9.0)]),
        f"specrag-4{ELSEWHERE}": run_of([(10, 2.0), (20, 4.0), (40, 30.0)]),
        f"thin-4{ELSEWHERE}": run_of([(10, 1.0), (20, 2.0), (40, 3.0)]),
    }
    headline = summary(runs, 4)
    assert headline["capacity_answers_per_s"] == 0 and headline[
        "thin_capacity_answers_per_s"
    ] == pytest.approx(9.9)
    assert headline["capacity_answers_per_s_embedding_elsewhere"] == pytest.approx(19.8)
    assert headline["capacity_ratio_vs_thin_embedding_elsewhere"] == 0.5
    assert headline["added_ttft_p99_ms_at_half_capacity_embedding_elsewhere"] == 2.0
    assert headline["cpu_ms_per_answer_embedding_elsewhere"]["specrag"] == {"total": 20}
    # No rate held in process, yet what each served at most compares them.
    assert headline["most_served_per_s"] == pytest.approx(9.9) == headline["thin_most_served_per_s"]
    assert headline["most_served_ratio_vs_thin"] == 1.0
    assert headline["most_served_ratio_vs_thin_embedding_elsewhere"] == pytest.approx(1.0)
    assert "capacity_answers_per_s_embedding_elsewhere" not in summary(
        {name: points for name, points in runs.items() if not name.endswith(ELSEWHERE)}, 4
    )


@pytest.mark.timeout(900)
def test_a_tiny_run_reports_every_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--data-dir", str(tmp_path), "--model", str(tiny_model_dir), "--rates", "3", "--seconds", "2"]
    headline = run(
        [
            *argv,
            "--replicas",
            "1",
            "--max-tokens",
            "2",
            "-k",
            "3",
            "--no-pin",
            "--no-mirror-rate",
            "--no-embedding-elsewhere",  # the session's index is WordLlama's, which no server serves
            "--profile",
            "--name",
            "capacity-test",
        ]
    )
    written = json.loads((OUT_DIR / "capacity-test.json").read_text())
    for key in (
        "capacity_answers_per_s",
        "capacity_ratio_vs_thin",
        "added_ttft_p99_ms_at_half_capacity",
        "mirror_lost_batches",
        "mirror_predicted_equals_delivered",
        "cpu_ms_per_answer",
        "most_served_ratio_vs_thin",
        "machine",
    ):
        assert key in written
    runs = written["runs"]
    assert set(runs) == {"specrag-1", "thin-1"}
    for points in runs.values():
        (only,) = points
        assert only["sent"] > 0 and only["failed"] == 0 and only["unmatched_answers"] == 0
        assert only["added_ttft_ms"]["n"] == only["answered"]
        assert only["cpu_ms_per_answer"]["total"] > 0
    specrag = runs["specrag-1"][0]
    assert specrag["cpu_ms_per_answer"]["embedding"] > 0 and specrag["kv_events_per_s"] > 0
    assert specrag["mirrors"][0]["exact"] is True
    assert specrag["engine_requests_per_answer"] >= 1 and specrag["searches_in_one_stage"] is not None
    assert runs["thin-1"][0]["searches_in_one_stage"] is None
    profiles = written["profiles"]
    assert set(profiles) == {"specrag-1", "thin-1"}
    for label, profile in profiles.items():
        assert profile["answers"] == runs[label][0]["answered"] and profile["process_ms"] > 0
        assert profile["by_component_ms"] and profile["top_inclusive_ms"]
    assert "http" in profiles["thin-1"]["by_component_ms"]
    assert headline["mirror_lost_batches"] == 0 and headline["mirror_predicted_equals_delivered"] is not None
    assert (OUT_DIR / "capacity-test.png").is_file()
