"""Engine faults under the controller: retry before the first token, bounded errors, recovery.

These run on the simulated engine (its fault hooks make every failure mode reproducible in
milliseconds); ``bench.faults`` and the engine-marked test below inject the same faults into the
real vLLM engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from specrag.cache.tree import KnowledgeTree
from specrag.controller.controller import RagController, RagRequest
from specrag.errors import EngineError, EngineUnavailableError
from specrag.pipeline.engines.supervisor import SupervisedEngine, SupervisorPolicy
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller, scripted_index
from tests.helpers.engines import FAST_POLICY, supervised
from tests.helpers.waiting import assert_engine_idle, wait_until

QUESTION = "What does the assert statement do?"


def controller_on(engine: SupervisedEngine, assets: Assets, **config: object) -> RagController:
    return make_controller(engine, assets, scripted_index(assets, [[1, 2, 3], [1, 2, 3]], 0.01), **config)


async def test_a_failure_before_the_first_token_is_retried_once(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.01))
    engine.fail_next(1)
    done = await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
    assert [e.kind for e in done.timeline.events].count("retry") == 1
    assert done.text
    engine.fail_next(2)
    with pytest.raises(EngineError, match="injected failure"):
        await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_an_engine_that_dies_mid_load_is_replaced_and_the_tree_cleared(tiny_assets: Assets) -> None:
    started: list[SimulatedEngine] = []
    trees: list[KnowledgeTree] = []  # the tree follows the engines' own KV events
    engine = await supervised(started, on_kv_events=lambda events: trees[0].apply_events(events))
    controller = controller_on(engine, tiny_assets)
    trees.append(controller.placement.replicas[0].tree)
    engine.on_restart(controller.placement.replicas[0].tree.engine_cache_cleared)
    resident_at_restart: list[bool] = []  # read right after the tree heard of the restart
    engine.on_restart(
        lambda: resident_at_restart.append(controller.placement.replicas[0].tree.system_prompt_resident())
    )
    await controller.answer(RagRequest(QUESTION, k=3, mode="all", max_tokens=4))
    assert not controller.placement.replicas[0].tree.uses_capacity_model
    assert controller.placement.replicas[0].tree.system_prompt_resident()

    queries = [
        asyncio.create_task(controller.answer(RagRequest(QUESTION, k=3, mode="all", max_tokens=200)))
        for _ in range(5)
    ]
    await asyncio.sleep(0.05)
    await started[0].die()
    results = await asyncio.wait_for(asyncio.gather(*queries, return_exceptions=True), timeout=10)
    # Each query either failed with a clear engine error or was retried on the new engine.
    assert all(isinstance(r, EngineError) or r.text for r in results)  # type: ignore[union-attr]
    assert await engine.wait_ready(5) and engine.restarts == 1 and len(started) == 2
    assert engine.last_recovery_s is not None and engine.last_recovery_s < 5
    assert resident_at_restart == [False]
    after = await controller.answer(RagRequest(QUESTION, k=3, mode="all", max_tokens=4))
    assert after.text
    assert controller.placement.replicas[
        0
    ].tree.system_prompt_resident()  # the new engine's events put it back
    await assert_engine_idle(started[1], controller)
    await engine.close()


async def test_a_hung_engine_is_detected_replaced_and_the_query_retried(tiny_assets: Assets) -> None:
    started: list[SimulatedEngine] = []
    engine = await supervised(started)
    controller = controller_on(engine, tiny_assets, first_token_timeout_s=0.5)
    started[0].stall()
    began = time.perf_counter()
    done = await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
    # The first attempt times out (0.5 s), the probe fails (0.3 s), the engine is replaced and
    # the prompt, which had produced nothing yet, is retried on the new engine.
    assert time.perf_counter() - began < 0.5 + 0.3 + 1.0 + 2.0
    assert [e.kind for e in done.timeline.events].count("retry") == 1 and done.text
    assert engine.restarts == 1 and engine.state == "ready"
    await assert_engine_idle(started[1], controller)
    await engine.close()


async def test_requests_fail_fast_while_the_engine_is_recovering(tiny_assets: Assets) -> None:
    gate = asyncio.Event()
    started: list[SimulatedEngine] = []

    async def slow_start() -> SimulatedEngine:
        if started:
            await gate.wait()  # the replacement takes as long as the test wants
        engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
        started.append(engine)
        return engine

    engine = await SupervisedEngine(slow_start, FAST_POLICY).start()
    controller = controller_on(engine, tiny_assets, first_token_timeout_s=0.5)
    await started[0].die()
    with pytest.raises(EngineError):
        await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
    assert engine.state == "recovering"
    began = time.perf_counter()
    with pytest.raises(EngineError, match="recovering"):
        await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
    assert time.perf_counter() - began < 2.0
    gate.set()
    assert await engine.wait_ready(5)
    assert (await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))).text
    await engine.close()


async def test_a_down_engine_answers_unavailable_at_once_and_is_retried_until_back(
    tiny_assets: Assets,
) -> None:
    started: list[SimulatedEngine] = []
    refusals = 8  # more than any fixed attempt budget would allow: it keeps trying

    async def start() -> SimulatedEngine:
        nonlocal refusals
        if started and refusals:
            refusals -= 1
            raise EngineError("connection refused")
        engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
        started.append(engine)
        return engine

    policy = SupervisorPolicy(probe_timeout_s=0.3, close_timeout_s=1.0, backoff_s=0.02, max_backoff_s=0.1)
    engine = await SupervisedEngine(start, policy).start()
    controller = controller_on(engine, tiny_assets, first_token_timeout_s=30)
    await started[0].die()
    for _ in range(2):  # the query that finds it dead, then one while it is down
        began = time.perf_counter()
        with pytest.raises(EngineUnavailableError):
            await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))
        assert time.perf_counter() - began < 5  # not the 30 s first-token timeout
    assert engine.state == "down"
    await wait_until(lambda: engine.state == "ready", within_s=10)
    assert refusals == 0 and engine.restarts == 1
    assert (await controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=4))).text
    await engine.close()


async def test_failures_during_shutdown_are_unavailable_and_not_repaired(tiny_assets: Assets) -> None:
    started: list[SimulatedEngine] = []
    engine = await supervised(started)
    controller = controller_on(engine, tiny_assets)
    query = asyncio.create_task(controller.answer(RagRequest(QUESTION, k=3, mode="serial", max_tokens=500)))
    await wait_until(lambda: bool(controller.in_flight_request_ids()), within_s=10)
    engine.begin_shutdown()
    await started[0].die()  # what Ctrl-C does to vLLM's own processes
    with pytest.raises(EngineUnavailableError, match="shutting down"):
        await query
    assert engine.status().state == "stopping" and len(started) == 1 and engine.restarts == 0
    await engine.close()


async def test_a_slot_granted_while_the_engine_is_replaced_is_given_back(tiny_assets: Assets) -> None:
    # Closing a hung engine fails the request holding the one prefill slot; the slot passes to a
    # queued final request while the supervisor is still starting the replacement. That request
    # must fail (503) and give its slot back: a slot kept would shut the pool for good, every
    # later request would queue behind it and, the queue full, be refused with 429 for ever.
    replace = asyncio.Event()
    started: list[SimulatedEngine] = []

    async def held_start() -> SimulatedEngine:
        if started:
            await replace.wait()
        engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
        started.append(engine)
        return engine

    engine = await SupervisedEngine(held_start, FAST_POLICY).start()
    controller = controller_on(engine, tiny_assets, first_token_timeout_s=30, max_prefill_bs=1)
    started[0].stall()
    request = RagRequest(QUESTION, k=3, mode="serial", max_tokens=4)
    holder = asyncio.create_task(controller.answer(request))
    await wait_until(lambda: controller.gate.pool == 1, within_s=10)
    queued = asyncio.create_task(controller.answer(request))
    await wait_until(lambda: controller.gate.waiting == 1, within_s=10)
    engine.report_failure("no first token")  # what a first-token timeout reports
    with pytest.raises(EngineUnavailableError, match="recovering"):
        await asyncio.wait_for(queued, timeout=10)
    assert engine.state == "recovering"  # the holder waits for the replacement, holding no slot
    assert (controller.gate.pool, controller.gate.waiting) == (0, 0)
    replace.set()
    retried = await asyncio.wait_for(holder, timeout=10)
    assert [e.kind for e in retried.timeline.events].count("retry") == 1 and retried.text
    assert (await asyncio.wait_for(controller.answer(request), timeout=10)).text
    await assert_engine_idle(started[1], controller)
    await engine.close()
