"""The supervisor against a real engine death: SIGKILL the vLLM engine core of a service of our own.

``test_faults`` covers every failure mode on the simulated engine; this one checks that the real
thing behaves the same: vLLM notices its engine core died, queries in flight get a clear error
(or are retried), the supervisor starts a new engine core, the service answers again, and no
request or process is left behind. It starts (and restarts) a separate small engine, never the
session's shared one, so it takes a minute or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from specrag.controller.controller import ControllerConfig, RagController, RagRequest
from specrag.errors import EngineError
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.engines.supervisor import SupervisedEngine, SupervisorPolicy
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assembly import open_controller
from specrag.service.run.assets import Assets
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.engine

QUESTION = "What does the assert statement do?"
# Generous correctness bounds: an error must come, and the engine must return, not hang.
ERROR_BOUND_S = 60.0
RECOVERY_BOUND_S = 300.0
CORE_EXIT_BOUND_S = 30.0


def core_pids() -> set[int]:
    return {
        child.pid
        for child in multiprocessing.active_children()
        if "EngineCore" in (child.name or "") and child.pid is not None
    }


async def test_a_killed_engine_core_is_replaced_without_leaks(
    tiny_model_dir: Path, tiny_assets: Assets, tmp_path: Path
) -> None:
    # KV events on IPC sockets of this test's own directory (no clash with the session engine):
    # the tree follows the real engine's cache. A smaller KV pool keeps the second engine light.
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=4096,
        kv_cache_gib=1,
        enforce_eager=True,
        startup_timeout_s=600,
    ).with_kv_events(tmp_path / "run")
    shared = core_pids()  # the session engine's core, if it runs: never touched

    async def start() -> Engine:
        return await VllmEngine.start(config)

    policy = SupervisorPolicy(probe_timeout_s=5.0, close_timeout_s=20.0, max_attempts=3, backoff_s=1.0)
    engine = await SupervisedEngine(start, policy).start()
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=engine.block_size)
    stack = open_controller(
        engine,
        config.kv_event_source(),
        tiny_assets.index,
        builder,
        ControllerConfig(first_token_timeout_s=10.0),
    )
    try:
        async with stack as (controller, _mirror):
            ours = await killed_and_replaced(engine, controller, shared)
    finally:
        await engine.close()
    # vLLM's shutdown signals its core and returns; the core then exits within seconds.
    for _ in range(round(CORE_EXIT_BOUND_S / 0.2)):
        if core_pids() <= shared:
            break
        await asyncio.sleep(0.2)
    assert core_pids() <= shared, "an engine core of ours outlived the engine"
    with contextlib.suppress(ProcessLookupError):
        os.kill(ours, 0)
        pytest.fail(f"the killed engine core {ours} still exists")


async def killed_and_replaced(engine: SupervisedEngine, controller: RagController, shared: set[int]) -> int:
    """Kill our engine core under load; check the errors, the recovery, the tree and the queues.

    Returns the killed core's pid, to check that it is gone once the engine is closed.
    """
    # Registered after open_controller's follower: it reads the tree once that one cleared it.
    resident_at_restart: list[bool] = []
    forget = engine.on_restart(
        lambda: resident_at_restart.append(controller.placement.replicas[0].tree.system_prompt_resident())
    )
    tree = controller.placement.replicas[0].tree
    (ours,) = core_pids() - shared
    await controller.answer(RagRequest(QUESTION, k=4, max_tokens=2))
    await wait_until(lambda: not tree.uses_capacity_model and tree.system_prompt_resident(), within_s=20)
    queries = [
        asyncio.create_task(controller.answer(RagRequest(QUESTION, k=4, max_tokens=400))) for _ in range(3)
    ]
    await asyncio.sleep(0.5)
    dying = engine.engine  # the adapter of the engine about to die (the supervisor replaces it)
    assert dying.known_failure() is None
    killed_at = time.perf_counter()
    os.kill(ours, signal.SIGKILL)
    # The adapter itself knows its engine core died, without a request: what lets a pool's health
    # check exclude the replica before vLLM fails the requests.
    await wait_until(lambda: dying.known_failure() is not None, within_s=ERROR_BOUND_S)
    assert "exited with code -9" in str(dying.known_failure())
    results = await asyncio.wait_for(asyncio.gather(*queries, return_exceptions=True), ERROR_BOUND_S)
    # Each query failed with a clear engine error or was retried on the new engine; none hung.
    for result in results:
        assert isinstance(result, EngineError) or result.text, result  # type: ignore[union-attr]

    assert await engine.wait_ready(RECOVERY_BOUND_S), engine.last_error
    assert engine.restarts == 1 and engine.state == "ready"
    assert engine.last_recovery_s is not None and time.perf_counter() - killed_at < RECOVERY_BOUND_S
    (replacement,) = core_pids() - shared
    assert replacement != ours
    assert resident_at_restart == [False]  # the tree forgot the dead engine's cache at once
    forget()

    after = await controller.answer(RagRequest(QUESTION, k=4, max_tokens=4))
    assert after.text and after.timeline.first_token is not None
    # The resubscribed mirror hears the new engine's events: the system prompt is back.
    await wait_until(tree.system_prompt_resident, within_s=20)
    for _ in range(100):
        counts = await engine.counts()
        if not controller.in_flight_request_ids() and counts.running == counts.waiting == 0:
            break
        await asyncio.sleep(0.1)
    assert controller.in_flight_request_ids() == set() and controller.gate.pool == 0
    counts = await engine.counts()
    assert (counts.running, counts.waiting, counts.unfinished) == (0, 0, 0)
    return ours
