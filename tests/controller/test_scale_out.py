"""Queries over several engine replicas: routing in the timeline, faults routed around.

Simulated replicas (each with its own tree fed by its own KV events); the engine-marked Ray test
(tests/service/test_ray_replicas.py) runs real vLLM replicas.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from specrag.cache.tree import KnowledgeTree
from specrag.client import AsyncClient
from specrag.controller.controller import RagController, RagRequest
from specrag.controller.placement import health_checks
from specrag.controller.replicas import Replica
from specrag.controller.timeline import Timeline, TimelineEvent
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import pool_controller, scripted_index, simulated_pool
from tests.helpers.http import metric, running
from tests.helpers.waiting import wait_until

QUESTION = "What does the assert statement do?"


def routes(timeline: Timeline) -> list[str]:
    """The replicas the answer's prompt was sent to (or adopted on), in order."""
    return [event.detail["replica"] for event in timeline.events if event.kind in ("route", "adopt")]


def kinds(timeline: Timeline, kind: str) -> list[TimelineEvent]:
    return [event for event in timeline.events if event.kind == kind]


async def ask(controller: RagController, max_tokens: int = 4, mode: str = "ordering") -> Timeline:
    done = await controller.answer(RagRequest(QUESTION, k=3, mode=mode, max_tokens=max_tokens))
    assert done.text
    return done.timeline


async def close(pool: list[Replica], controller: RagController) -> None:
    await controller.close()
    for replica in pool:
        await replica.engine.close()


async def test_a_repeated_query_returns_to_the_replica_that_holds_its_documents(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 3)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[4, 5, 6]], 0.0))
    first = await ask(controller)
    (chosen,) = routes(first)
    second = await ask(controller)
    assert routes(second) == [chosen]
    assert second.cached_prompt_tokens > first.cached_prompt_tokens
    (route,) = kinds(second, "route")
    assert route.detail["reason"] == "lowest estimated TTFT" and route.detail["predicted_cached_tokens"] > 0
    await close(pool, controller)


async def test_speculation_and_the_final_prompt_run_on_the_same_replica(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    index = scripted_index(tiny_assets, [[7, 8, 9], [7, 8, 9], [7, 8, 9]], 0.05)
    controller = pool_controller(pool, tiny_assets, index, num_stages=3, speculation="always")
    timeline = await ask(controller, mode="all")
    assert timeline.adopted
    submits = [event.detail["replica"] for event in kinds(timeline, "spec_submit")]
    assert submits and routes(timeline) == submits[-1:]
    await close(pool, controller)


async def test_a_dead_replica_is_routed_around_and_waiting_queries_retried(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    queries = [asyncio.create_task(ask(controller, max_tokens=50)) for _ in range(6)]
    await wait_until(lambda: pool[0].pending > 0, within_s=5, every_s=0.001)
    engine = pool[0].engine
    assert isinstance(engine, SimulatedEngine)
    await engine.die()
    timelines = await asyncio.wait_for(asyncio.gather(*queries), timeout=10)  # none fails
    retried = [timeline for timeline in timelines if kinds(timeline, "retry")]
    assert retried and all(routes(timeline)[-1] == "r1" for timeline in retried)
    assert pool[0].excluded is not None and not pool[0].tree.system_prompt_resident()
    assert (await controller.health()).serving
    assert routes(await ask(controller)) == ["r1"]
    await close(pool, controller)


@pytest.mark.parametrize(
    ("first_token_timeout_s", "stall_timeout_s", "reason"),
    [
        (0.3, 600.0, "no first token"),  # a query's first-token timeout notices it
        (600.0, 0.5, "stalled"),  # the health check's watchdog notices it long before that timeout
    ],
)
async def test_a_stalled_replica_is_excluded_and_rejoins_when_it_steps_again(
    tiny_assets: Assets, first_token_timeout_s: float, stall_timeout_s: float, reason: str
) -> None:
    pool = simulated_pool(tiny_assets, 2)
    index = scripted_index(tiny_assets, [[1, 2, 3]], 0.0)
    controller = pool_controller(pool, tiny_assets, index, first_token_timeout_s=first_token_timeout_s)
    engine = pool[0].engine
    assert isinstance(engine, SimulatedEngine)
    engine.stall()
    async with health_checks(controller.placement, every_s=0.05, stall_timeout_s=stall_timeout_s):
        timelines = await asyncio.wait_for(asyncio.gather(*(ask(controller) for _ in range(4))), 30)
        assert all(routes(timeline)[-1] == "r1" for timeline in timelines)
        assert pool[0].excluded is not None and reason in pool[0].excluded
        engine.resume()
        await wait_until(lambda: pool[0].excluded is None, within_s=5)
    await close(pool, controller)


async def test_a_pause_of_the_service_itself_is_not_blamed_on_its_replicas(tiny_assets: Assets) -> None:
    """The event loop blocked (a long synchronous call, a collection, a descheduled VM) while both
    replicas held requests: when it runs again the watchdog's check is due before any first token
    that came meanwhile is seen. Only the replica that is still stalled afterwards is excluded."""
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    engines = [replica.engine for replica in pool if isinstance(replica.engine, SimulatedEngine)]
    assert len(engines) == 2
    for engine in engines:
        engine.stall()
    async with health_checks(controller.placement, every_s=0.05, stall_timeout_s=0.5):
        queries = [asyncio.create_task(ask(controller)) for _ in range(4)]
        await wait_until(lambda: all(replica.pending > 0 for replica in pool), within_s=5, every_s=0.001)
        time.sleep(0.8)  # noqa: ASYNC251 (on purpose: the service does not run; its check falls due)
        engines[1].resume()
        timelines = await asyncio.wait_for(asyncio.gather(*queries), 30)
        assert pool[1].excluded is None
        assert pool[0].excluded is not None and "stalled" in pool[0].excluded
        assert all(routes(timeline)[-1] == "r1" for timeline in timelines)
        engines[0].resume()
    await close(pool, controller)


async def test_a_submitted_prompts_path_is_in_its_replicas_tree_before_its_first_token(
    tiny_assets: Assets,
) -> None:
    """So that a prompt placed meanwhile can follow its order and see its blocks as they are stored."""
    pool = simulated_pool(tiny_assets, 1)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[4, 5, 6]], 0.0))
    engine, tree = pool[0].engine, pool[0].tree
    assert isinstance(engine, SimulatedEngine)
    engine.stall()
    answering = asyncio.create_task(ask(controller))
    await wait_until(lambda: pool[0].pending > 0, within_s=5)
    assert len(tree) == 3  # the path of its three documents
    assert tree.popularity(4) == 0  # pending, not served
    engine.resume()
    await asyncio.wait_for(answering, 10)
    assert tree.popularity(4) == 1
    await close(pool, controller)


async def test_with_every_replica_down_the_health_check_says_so(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    await pool[0].engine.close()
    assert (await controller.health()).serving
    await pool[1].engine.close()
    health = await controller.health()
    assert not health.serving and "r0" in str(health.reason) and "r1" in str(health.reason)
    await controller.close()


async def test_metrics_count_answers_by_replica_and_reason(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    metrics = ServiceMetrics()
    timeline = await ask(controller)
    metrics.observe(timeline)
    (replica,) = routes(timeline)
    text = metrics.exposition().decode()
    assert metric(text, "specrag_routed_total", reason="lowest estimated TTFT", replica=replica) == 1
    await close(pool, controller)


class KnownDeadEngine(SimulatedEngine):
    """A simulated engine that stops stepping and says it died, as a killed vLLM engine core does."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.dead = False

    def known_failure(self) -> str | None:
        return "engine core exited" if self.dead else None


async def test_a_replica_whose_engine_knows_it_died_is_excluded_at_once(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    system = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=32).system_layout_tokens()
    tree = KnowledgeTree(system, block_size=32)
    options: dict[str, Any] = {"time_scale": 0.01, "max_model_len": 4096}
    dying = KnownDeadEngine(block_size=32, on_kv_events=tree.apply_events, **options)
    pool[0] = Replica("r0", dying, tree)
    index = scripted_index(tiny_assets, [[1, 2, 3]], 0.0)
    controller = pool_controller(pool, tiny_assets, index, first_token_timeout_s=600)
    dying.stall()
    dying.dead = True
    async with health_checks(controller.placement, every_s=0.05, stall_timeout_s=600):
        timelines = await asyncio.wait_for(asyncio.gather(*(ask(controller) for _ in range(4))), 30)
        assert all(routes(timeline)[-1] == "r1" for timeline in timelines)
        assert pool[0].excluded == "engine core exited"
    dying.resume()
    await close(pool, controller)


async def test_health_reports_every_replicas_facts_over_http(tiny_assets: Assets) -> None:
    """/health says, per replica, whether it routes, what waits there, its speed and profile."""
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    pool[1].exclude("down for the test")
    async with running(controller) as url, AsyncClient(url) as client:
        body = await client.health()
    assert body["status"] == "ok"
    assert [(r["name"], r["available"], r["excluded"]) for r in body["replicas"]] == [
        ("r0", True, None),
        ("r1", False, "down for the test"),
    ]
    assert all(
        r["pending"] == 0 and r["speed"] == 1.0 and r["profile_measured"] is False for r in body["replicas"]
    )
    for replica in pool:
        await replica.engine.close()
