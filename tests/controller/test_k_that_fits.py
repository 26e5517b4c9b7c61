"""A ``k`` whose prompt cannot fit the model's context is refused with the largest k that fits."""

from __future__ import annotations

import re

import pytest

from specrag.controller.controller import RagRequest
from specrag.errors import InvalidInputError
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller

QUESTION = "How does asyncio.run close the loop?"


async def test_a_k_too_large_for_the_context_is_refused_naming_the_largest_that_fits(
    tiny_assets: Assets,
) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=2048)
    controller = make_controller(engine, tiny_assets)
    with pytest.raises(
        InvalidInputError, match=r"exceeds the model's limit.*largest k that fits is"
    ) as refused:
        await controller.answer(RagRequest(QUESTION, k=30, mode="serial", max_tokens=64))
    match = re.search(r"largest k that fits is (\d+)", str(refused.value))
    assert match is not None
    fitting = int(match[1])
    assert 1 <= fitting < 30
    answered = await controller.answer(RagRequest(QUESTION, k=fitting, mode="serial", max_tokens=64))
    assert len(answered.timeline.documents) == fitting
    with pytest.raises(InvalidInputError, match="exceeds"):  # and it is the largest
        await controller.answer(RagRequest(QUESTION, k=fitting + 1, mode="serial", max_tokens=64))
    await engine.close()


async def test_a_question_too_long_for_any_passage_says_so(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=512)
    controller = make_controller(engine, tiny_assets)
    with pytest.raises(InvalidInputError, match="not even one passage fits: shorten the question"):
        await controller.answer(RagRequest(QUESTION * 20, k=3, mode="serial", max_tokens=64))
    await engine.close()
