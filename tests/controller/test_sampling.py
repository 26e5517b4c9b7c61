"""Decoding settings checked like OpenAI checks them, before any engine work (no real engine needed)."""

from __future__ import annotations

import math

import pytest

from specrag.controller.config import ControllerConfig
from specrag.controller.query import RagRequest
from specrag.controller.sampling import check_sampling
from specrag.errors import InvalidInputError
from specrag.pipeline.engines.protocol import Sampling
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, make_controller
from tests.helpers.engines import run_prompt


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


def test_penalties_pass_through_and_unset_ones_take_the_defaults() -> None:
    request = RagRequest("q", frequency_penalty=-2, presence_penalty=2, repetition_penalty=1.5)
    sampling = check_sampling(request, 8)
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (
        -2,
        2,
        1.5,
    )
    assert sampling.penalties == ("frequency_penalty", "presence_penalty", "repetition_penalty")
    defaults = {"frequency_penalty": 0.3, "presence_penalty": 0.0, "repetition_penalty": 1.2}
    defaulted = check_sampling(RagRequest("q", repetition_penalty=1), 8, defaults)
    # The request's neutral value wins over the default; the penalty it leaves unset is the default's.
    assert (defaulted.frequency_penalty, defaulted.repetition_penalty) == (0.3, 1.0)
    assert check_sampling(RagRequest("q"), 8).penalties == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be between -2 and 2, got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be between -2 and 2, got -3"),
        ({"presence_penalty": math.nan}, "presence_penalty must be a finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0, got 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty must be a number"),
    ],
)
def test_out_of_range_penalties_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        check_sampling(RagRequest("q", **fields), 8)  # type: ignore[arg-type]


def test_a_default_penalty_out_of_range_is_refused_by_its_flag() -> None:
    with pytest.raises(InvalidInputError, match="--repetition-penalty must be greater than 0"):
        ControllerConfig(repetition_penalty=0, names={"repetition_penalty": "--repetition-penalty"})


async def test_an_engine_without_penalties_refuses_a_requested_one_by_name(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    try:
        controller = make_controller(engine, tiny_assets, repetition_penalty=1.2, frequency_penalty=0.4)
        with pytest.raises(InvalidInputError, match="presence_penalty: not supported by this engine"):
            controller.check(RagRequest(QUESTION, presence_penalty=0.5))
        # The service's default is for engines that apply it: here a request runs without it.
        checked = controller.check(RagRequest(QUESTION, k=2, max_tokens=2))
        assert checked.sampling.penalties == ()
        with pytest.raises(InvalidInputError, match="repetition_penalty: not supported"):
            await run_prompt(engine, [1, 2, 3], Sampling(max_tokens=2, repetition_penalty=1.1))
    finally:
        await engine.close()
