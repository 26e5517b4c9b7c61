"""The service's assembly in parts: a controller over the supervised engine, as benchmarks open it.

On the simulated engine under the supervisor (fast): a controller follows the engine's restarts
while it is open and no longer once it is closed, and ``empty_cache`` empties the prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest_asyncio

from specrag.controller.controller import ControllerConfig, RagRequest
from specrag.pipeline.simulated_engine import SimulatedEngine
from specrag.service.assembly import open_controller, prompt_builder
from specrag.service.assets import Assets
from specrag.service.supervisor import SupervisedEngine
from tests.helpers import QUESTION, random_prompt, run_prompt, supervised


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
        assert controller.tree.system_prompt_resident()
        await recovering.kill_and_recover()
        assert not controller.tree.system_prompt_resident()
        await controller.answer(request)
    assert controller.tree.system_prompt_resident()
    await recovering.kill_and_recover()
    assert controller.tree.system_prompt_resident()  # closed: its hook is gone


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
