"""The service's assembly in parts: a controller over the supervised engine, as benchmarks open it,
and a pool of supervised engines.

On the simulated engine under the supervisor (fast): a controller follows the engine's restarts
while it is open and no longer once it is closed, and ``empty_cache`` empties the prefix cache; a
pool's engine is followed through its supervisor's replacements and the placement's exclusions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest_asyncio

from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.pipeline.engines.supervisor import SupervisedEngine
from specrag.service.run.assembly import open_controller, prompt_builder
from specrag.service.run.assets import Assets
from specrag.service.run.pools import PoolEngine, open_pool
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION
from tests.helpers.engines import random_prompt, run_prompt, supervised
from tests.helpers.waiting import wait_until


@dataclass
class Recovering:
    """A supervised simulated engine, and how to kill the one in service and wait for its successor."""

    engine: SupervisedEngine
    started: list[SimulatedEngine]

    async def kill_and_recover(self) -> None:
        await self.started[-1].die()
        self.engine.report_failure("killed by the test")
        assert await self.engine.wait_ready(5) and self.engine.state == "ready"


@pytest_asyncio.fixture(loop_scope="session")
async def recovering() -> AsyncIterator[Recovering]:
    started: list[SimulatedEngine] = []
    engine = await supervised(started)
    yield Recovering(engine, started)
    await engine.close()


async def test_only_the_callbacks_still_registered_run_after_a_restart(recovering: Recovering) -> None:
    calls: list[str] = []
    forget = recovering.engine.on_restart(lambda: calls.append("forgotten"))
    recovering.engine.on_restart(lambda: calls.append("kept"))
    forget()
    await recovering.kill_and_recover()
    assert calls == ["kept"]


async def test_an_open_controller_forgets_the_cache_on_a_restart_a_closed_one_no_longer_follows(
    recovering: Recovering, tiny_assets: Assets
) -> None:
    engine = recovering.engine
    builder = prompt_builder(tiny_assets, engine)
    request = RagRequest(QUESTION, k=3, mode="all", max_tokens=2)
    async with open_controller(engine, None, tiny_assets.index, builder, ControllerConfig()) as (
        controller,
        mirror,
    ):
        assert mirror is None  # no KV events: the tree keeps its capacity model
        await controller.answer(request)
        assert controller.placement.replicas[0].tree.system_prompt_resident()
        await recovering.kill_and_recover()
        assert not controller.placement.replicas[0].tree.system_prompt_resident()
        await controller.answer(request)
    assert controller.placement.replicas[0].tree.system_prompt_resident()
    await recovering.kill_and_recover()
    assert controller.placement.replicas[0].tree.system_prompt_resident()  # closed: its hook is gone


async def test_empty_cache_starts_the_controller_on_an_empty_prefix_cache(
    recovering: Recovering, tiny_assets: Assets
) -> None:
    engine = recovering.engine
    prompt = random_prompt(seed=1, length=256)
    await run_prompt(engine, prompt)
    assert ((await run_prompt(engine, prompt))[0].cached_tokens or 0) > 0
    builder = prompt_builder(tiny_assets, engine)
    async with open_controller(
        engine, None, tiny_assets.index, builder, ControllerConfig(), empty_cache=True
    ):
        assert (await run_prompt(engine, prompt))[0].cached_tokens == 0


async def test_a_pool_s_supervised_engine_is_excluded_replaced_and_rejoins_with_an_empty_tree(
    tiny_assets: Assets,
) -> None:
    started: list[list[SimulatedEngine]] = [[], []]
    engines = [await supervised(started[i]) for i in range(2)]
    members = [PoolEngine(f"r{i}", engine, None) for i, engine in enumerate(engines)]
    builder = prompt_builder(tiny_assets, engines[0])
    request = RagRequest(QUESTION, k=3, mode="ordering", max_tokens=2)
    async with open_pool(members, builder.system_layout_tokens(), "round_robin") as pool:
        controller = RagController(pool.placement, tiny_assets.index, builder)
        for _ in range(2):  # round robin: one answer on each engine
            await controller.answer(request)
        first, second = pool.placement.replicas
        assert first.tree.system_prompt_resident() and second.tree.system_prompt_resident()

        # A replacement the supervisor decided alone: the tree forgets the old engine's cache.
        await started[1][-1].die()
        engines[1].report_failure("killed by the test")
        assert await engines[1].wait_ready(5)
        assert not second.tree.system_prompt_resident() and second.excluded is None

        # A failure the placement hears of: excluded at once, back once its replacement answers.
        await started[0][-1].die()
        pool.placement.report_failure(first, "killed by the test")
        assert first.excluded is not None
        await wait_until(lambda: first.excluded is None, within_s=10)
        assert engines[0].restarts == engines[1].restarts == 1
        await controller.close()
    for engine in engines:
        await engine.close()
