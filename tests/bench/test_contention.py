"""bench.pipeline.contention's figures: medians, p99 and the ratio to the search alone."""

from __future__ import annotations

from bench.pipeline.contention import describe


def test_a_condition_is_described_by_its_median_p99_and_ratio_to_alone() -> None:
    alone = [10.0] * 99 + [50.0]
    beside = [20.0] * 99 + [90.0]
    assert describe(alone, None) == {"count": 100, "median_ms": 10.0, "p99_ms": 10.0}
    figures = describe(beside, alone)
    assert figures["median_ms"] == 20.0 and figures["median_over_alone"] == 2.0
    assert describe([1.0, 2.0, 3.0], None)["p99_ms"] == 3.0
