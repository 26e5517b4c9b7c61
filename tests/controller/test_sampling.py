"""Decoding settings checked like OpenAI checks them, before any engine work (no engine needed)."""

from __future__ import annotations

import math

import pytest

from specrag.controller.query import RagRequest
from specrag.controller.sampling import check_sampling
from specrag.errors import InvalidInputError
from specrag.pipeline.engines.protocol import Sampling


def test_the_defaults_are_greedy_and_set_fields_pass_through() -> None:
    assert check_sampling(RagRequest("q"), 8) == Sampling(max_tokens=8)
    request = RagRequest("q", temperature=2, top_p=0.5, seed=2**63 - 1, stop="###")
    assert check_sampling(request, 8) == Sampling(
        max_tokens=8, temperature=2.0, top_p=0.5, seed=2**63 - 1, stop=("###",)
    )
    assert check_sampling(RagRequest("q", stop=["a", "b"]), 8).stop == ("a", "b")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 2.5}, "temperature must be between 0 and 2"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": True}, "temperature must be a number, got True"),
        ({"top_p": 1.5}, "top_p must be greater than 0 and at most 1"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"seed": 2**63}, "seed must be an integer between 0 and 2**63 - 1"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"stop": ["a"] * 5}, "stop takes at most 4 strings, got 5"),
        ({"stop": "x" * 201}, "each stop string must have 1 to 200 characters"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
    ],
)
def test_out_of_range_or_mistyped_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message.replace("*", r"\*")):
        check_sampling(RagRequest("q", **fields), 8)  # type: ignore[arg-type]
