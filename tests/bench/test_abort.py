"""bench.pipeline.abort's figures: the median and the worst of the tries."""

from __future__ import annotations

from bench.pipeline.abort import describe


def test_a_measure_is_its_median_and_its_maximum() -> None:
    assert describe([41.04, 39.0, 51.1]) == {"median": 41.0, "max": 51.1}
    assert describe([71.1]) == {"median": 71.1, "max": 71.1}
