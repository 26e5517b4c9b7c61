"""The service's assembly in parts: a controller over the supervised engine, as benchmarks open it.

On the simulated engine under the supervisor (fast): a controller follows the engine's restarts
while it is open and no longer once it is closed, and ``empty_cache`` empties the prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest_asyncio

from specrag.controller.controller import ControllerConfig, RagRequest
from specrag.pipeline.simulated_engine import SimulatedEngine
from specrag.service.assembly import open_controller, prompt_builder
from specrag.service.assets import Assets
from specrag.service.supervisor import SupervisedEngine, SupervisorPolicy
from tests.helpers import QUESTION, random_prompt, run_prompt

FAST_POLICY = SupervisorPolicy(probe_timeout_s=0.3, close_timeout_s=1.0, max_attempts=3, backoff_s=0.05)


@dataclass
class Supervised:
    engine: SupervisedEngine
    started: list[SimulatedEngine] = field(default_factory=list)

    async def kill_and_recover(self) -> None:
        """The engine in service dies; the supervisor notices and starts a new one."""
        await self.started[-1].die()
        self.engine.report_failure("killed by the test")
        assert await self.engine.wait_ready(5) and self.engine.state == "ready"


@pytest_asyncio.fixture(loop_scope="session")
async def supervised() -> AsyncIterator[Supervised]:
    started: list[SimulatedEngine] = []

    async def start() -> SimulatedEngine:
        started.append(SimulatedEngine(time_scale=0.01, max_model_len=4096))
        return started[-1]

    engine = await SupervisedEngine(start, FAST_POLICY).start()
    yield Supervised(engine, started)
    await engine.close()


async def test_only_the_callbacks_still_registered_run_after_a_restart(supervised: Supervised) -> None:
    calls: list[str] = []
    forget = supervised.engine.on_restart(lambda: calls.append("forgotten"))
    supervised.engine.on_restart(lambda: calls.append("kept"))
    forget()
    await supervised.kill_and_recover()
    assert calls == ["kept"]


async def test_an_open_controller_forgets_the_cache_on_a_restart_a_closed_one_no_longer_follows(
    supervised: Supervised, tiny_assets: Assets
) -> None:
    engine = supervised.engine
    builder = prompt_builder(tiny_assets, engine)
    request = RagRequest(QUESTION, k=3, mode="all", max_tokens=2)
    async with open_controller(engine, None, tiny_assets.index, builder, ControllerConfig()) as (
        controller,
        mirror,
    ):
        assert mirror is None  # no KV events: the tree keeps its capacity model
        await controller.answer(request)
        assert controller.tree.system_prompt_resident()
        await supervised.kill_and_recover()
        assert not controller.tree.system_prompt_resident()
        await controller.answer(request)
    assert controller.tree.system_prompt_resident()
    await supervised.kill_and_recover()
    assert controller.tree.system_prompt_resident()  # closed: its hook is gone


async def test_empty_cache_starts_the_controller_on_an_empty_prefix_cache(
    supervised: Supervised, tiny_assets: Assets
) -> None:
    engine = supervised.engine
    prompt = random_prompt(seed=1, length=256)
    await run_prompt(engine, prompt)
    assert ((await run_prompt(engine, prompt))[0].cached_tokens or 0) > 0
    builder = prompt_builder(tiny_assets, engine)
    async with open_controller(
        engine, None, tiny_assets.index, builder, ControllerConfig(), empty_cache=True
    ):
        assert (await run_prompt(engine, prompt))[0].cached_tokens == 0
