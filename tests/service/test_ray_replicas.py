"""Two real vLLM replicas as Ray actors on a local Ray instance: queries through both, a kill.

Marked ``engine`` (it starts vLLM twice); skipped when Ray (``specrag[ray]``) is not installed.
Ray is always shut down, and the whole test is bounded in time.
"""

from __future__ import annotations

import asyncio

import pytest

from specrag.controller.controller import RagController, RagRequest
from specrag.errors import EngineError
from specrag.pipeline.engines.config import EngineConfig
from specrag.service.run.assets import Assets
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pools import open_pool, open_ray_engines
from tests.helpers.builders import scripted_index
from tests.helpers.engines import random_prompt, run_prompt
from tests.helpers.waiting import wait_until

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


async def test_two_ray_replicas_answer_queries_and_a_killed_one_is_routed_around(
    tiny_assets: Assets, tiny_engine_config: EngineConfig
) -> None:
    from specrag.pipeline.engines.ray_engine import RayEngine
    from specrag.pipeline.store.prompt import PromptBuilder

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        options = ServiceOptions(ray_address="", replicas=2, router="round_robin", eager=True)
        system = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store).system_token_ids
        async with (
            open_ray_engines(tiny_engine_config, options) as engines,
            open_pool(engines, system, options.router) as pool,
        ):
            placement = pool.placement
            builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=32)
            index = scripted_index(tiny_assets, [[1, 2, 3]], 0.0)
            controller = RagController(placement, index, builder)
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        controller.answer(
                            RagRequest("What does assert do?", k=3, mode="ordering", max_tokens=4)
                        )
                        for _ in range(4)
                    )
                ),
                timeout=120,
            )
            served = {e.detail["replica"] for a in answers for e in a.timeline.events if e.kind == "route"}
            assert served == {"r0", "r1"} and all(a.text for a in answers)
            # Each replica's own KV events reached its own tree.
            for replica in placement.replicas:
                await wait_until(lambda r=replica: not r.tree.uses_capacity_model, within_s=30)  # type: ignore[misc]
                assert replica.tree.system_prompt_resident()

            victim = placement.replicas[1].engine
            assert isinstance(victim, RayEngine)
            victim.kill()
            with pytest.raises(EngineError):
                await asyncio.wait_for(run_prompt(victim, random_prompt(1, 40)), timeout=30)
            placement.report_failure(placement.replicas[1], "killed")
            after = await asyncio.wait_for(
                controller.answer(RagRequest("What does assert do?", k=3, mode="ordering", max_tokens=4)), 60
            )
            assert after.text and [
                e.detail["replica"] for e in after.timeline.events if e.kind == "route"
            ] == ["r0"]
            await controller.close()
    finally:
        ray.shutdown()
