"""bench.turbo's error measure: the max over layers of the relative error, keys and values apart."""

from __future__ import annotations

import torch

from bench.turbo import relative_errors


def test_relative_errors_take_the_worst_layer() -> None:
    reference = torch.ones(3, 2, 2, 4, 8)
    actual = reference.clone()
    actual[1, 0] *= 1.01  # layer 1's keys 1 % off
    actual[2, 1] *= 0.95  # layer 2's values 5 % off
    errors = relative_errors(actual.to(torch.bfloat16), reference)
    assert errors["keys"] == 0.0078125  # bfloat16 rounds 1.01 to 1.0078125
    assert errors["values"] == 0.05078125  # and 0.95 to 0.94921875
    assert relative_errors(reference, reference) == {"keys": 0.0, "values": 0.0}
