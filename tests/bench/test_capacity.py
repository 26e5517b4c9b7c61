"""bench.capacity: the capacity rule, and a tiny run through both fronts in front of one stand-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.capacity.__main__ import run
from bench.capacity.report import capacity_of
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
    assert headline["mirror_lost_batches"] == 0 and headline["mirror_predicted_equals_delivered"] is not None
    assert (OUT_DIR / "capacity-test.png").is_file()
