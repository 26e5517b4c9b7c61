"""bench.pipeline.turbo's measures: the KV error (max over layers, keys and values apart), accuracy
intervals."""

from __future__ import annotations

from typing import Any

import torch

from bench.pipeline.turbo import accuracy_intervals, relative_errors


def test_relative_errors_take_the_worst_layer() -> None:
    reference = torch.ones(3, 2, 2, 4, 8)
    actual = reference.clone()
    actual[1, 0] *= 1.01  # layer 1's keys 1 % off
    actual[2, 1] *= 0.95  # layer 2's values 5 % off
    errors = relative_errors(actual.to(torch.bfloat16), reference)
    assert errors["keys"] == 0.0078125  # bfloat16 rounds 1.01 to 1.0078125
    assert errors["values"] == 0.05078125  # and 0.95 to 0.94921875
    assert relative_errors(reference, reference) == {"keys": 0.0, "values": 0.0}


def test_accuracy_intervals_pair_the_two_ways_question_by_question() -> None:
    def record(full: float, turbo: float) -> dict[str, Any]:
        return {"full": {"accuracy": full}, "turbo": {"accuracy": turbo}}

    intervals = accuracy_intervals([record(1, 0)] * 6 + [record(1, 1)] * 4)
    assert intervals["full_ci"] == [1.0, 1.0]
    low, high = intervals["delta_ci"]
    assert -1 < low <= -0.6 <= high < 0  # turbo lost 6 of 10, every time it differed
    assert accuracy_intervals([]) == {}
