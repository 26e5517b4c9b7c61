"""Through the live stack on a real engine with a small prefix cache: every answer's predicted
cached tokens equal those the engine delivered, through concurrent identical questions (duplicate
blocks), evictions, and the first questions again; the mirror ends exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from specrag.controller.config import ControllerConfig
from specrag.controller.controller import RagRequest
from specrag.controller.query import AnswerDone
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.run.assembly import open_controller, prompt_builder
from specrag.service.run.assets import Assets
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.engine

CACHE_TOKENS = 4096  # the smallest the tiny engine accepts: one prompt of its max_model_len


@pytest_asyncio.fixture(loop_scope="session")
async def bounded_engine(
    tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VllmEngine, EngineConfig]]:
    config = tiny_engine_config.with_overrides(kv_cache_tokens=CACHE_TOKENS).with_kv_events(
        tmp_path_factory.mktemp("bounded-engine")
    )
    engine = await VllmEngine.start(config)
    try:
        yield engine, config
    finally:
        await engine.close()


@pytest.mark.timeout(900)
async def test_predictions_equal_the_engines_hits_through_duplicates_and_evictions(
    bounded_engine: tuple[VllmEngine, EngineConfig], tiny_assets: Assets
) -> None:
    engine, config = bounded_engine
    questions = [f"What does {passage.title} say?" for passage in tiny_assets.passages[::7][:27]]
    first, others = questions[:3], questions[3:]
    builder = prompt_builder(tiny_assets, engine)
    async with open_controller(
        engine, config.kv_event_source(), tiny_assets.index, builder, ControllerConfig(), empty_cache=True
    ) as (controller, mirror):
        assert mirror is not None

        async def ask(question: str) -> AnswerDone:
            return await controller.answer(RagRequest(question, k=3, mode="ordering", max_tokens=2))

        answers: list[AnswerDone] = []
        for question in first:  # four at once: the engine computes the same blocks in parallel
            answers += await asyncio.gather(*(ask(question) for _ in range(4)))
        for question in others:  # enough other prompts to evict the first ones
            answers.append(await ask(question))
        for question in first:
            answers.append(await ask(question))
        timelines = [done.timeline for done in answers]
        pairs = [(timeline.predicted_cached_tokens, timeline.cached_prompt_tokens) for timeline in timelines]
        assert [pair for pair in pairs if pair[0] != pair[1]] == []
        await wait_until(lambda: mirror.status.exact, within_s=10)
        counts = mirror.tree.mirror_counts
        assert counts.expired_predictions == 0 and mirror.faults().lost_batches == 0
    # The other questions' prompts alone were more than twice the cache: it had to evict.
    assert sum(timeline.prompt_tokens for timeline in timelines[12:-3]) > 2 * CACHE_TOKENS
