"""The knowledge tree follows the real engine's prefix cache through vLLM's KV-cache events."""

from __future__ import annotations

import pytest

from specrag.controller.controller import RagRequest
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.kv_mirror.mirror import KVMirror
from specrag.service.run.assets import Assets
from tests.helpers.builders import make_controller, scripted_index
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.engine


async def test_served_documents_become_resident_and_a_reset_clears_them(
    vllm_engine: VllmEngine, tiny_assets: Assets, tiny_engine_config: EngineConfig
) -> None:
    await vllm_engine.reset_prefix_cache()
    controller = make_controller(vllm_engine, tiny_assets, scripted_index(tiny_assets, [[20, 21, 22]], 0.01))
    source = tiny_engine_config.kv_event_source()
    assert source is not None
    mirror = KVMirror(controller.placement.replicas[0].tree, source)
    await mirror.start()
    try:
        assert mirror.active
        done = await controller.answer(RagRequest("What is a frozenset?", k=3, mode="ordering", max_tokens=2))
        order = list(done.prompt.document_ids())
        # The first event retires the capacity model; a late subscriber first replays the
        # engine's backlog, which may take a moment after other tests.
        await wait_until(lambda: not controller.placement.replicas[0].tree.uses_capacity_model, within_s=20)
        await wait_until(lambda: controller.placement.replicas[0].tree.cached_prefix(order).docs == 3)
        assert controller.placement.replicas[0].tree.system_prompt_resident()

        await controller.reset_prefix_cache()
        assert not controller.placement.replicas[0].tree.system_prompt_resident()
        assert controller.placement.replicas[0].tree.cached_prefix(order).tokens == 0
        # The engine's own answer: the question again finds nothing cached ("ordering" runs no
        # warm-up or speculation before it), and the tree predicted exactly that.
        question = RagRequest("What is a frozenset?", k=3, mode="ordering", max_tokens=2)
        again = await controller.answer(question)
        assert again.timeline.cached_prompt_tokens == 0
        assert again.timeline.predicted_cached_tokens == 0
        # Once the mirror has heard of that request's blocks, the tree holds them again.
        again_order = list(again.prompt.document_ids())
        await wait_until(lambda: controller.placement.replicas[0].tree.cached_prefix(again_order).docs == 3)
    finally:
        await mirror.stop()
        await controller.close()
