"""The controller measures the engine's prefill profile from the answers it serves."""

from __future__ import annotations

from specrag.controller.controller import RagRequest
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller, questions


async def test_served_answers_replace_the_default_profile_in_the_tree(tiny_assets: Assets) -> None:
    # Unscaled enough that a prefill's time is well above the timer's granularity.
    engine = SimulatedEngine(time_scale=0.2, max_model_len=4096)
    controller = make_controller(engine, tiny_assets)
    estimator = controller.prefill_estimator
    default = controller.placement.replicas[0].tree.profile
    assert not default.measured and estimator.profile is default

    asked = questions(tiny_assets, estimator.min_samples + 4)
    for question in asked[: estimator.min_samples - 1]:
        await controller.answer(RagRequest(question, k=4, max_tokens=1))
    assert (
        controller.placement.replicas[0].tree.profile is default
    )  # too few answers yet: the default, labelled so

    for question in asked[estimator.min_samples - 1 :]:
        await controller.answer(RagRequest(question, k=4, max_tokens=1))
    assert estimator.samples == len(asked)  # every answer was measured
    measured = controller.placement.replicas[0].tree.profile
    assert measured.measured and measured is estimator.profile
    assert measured.cost(0, 512) > 0
    await engine.close()
