"""The service over the query core's facade, on the simulated engine: supervision found without
asking the engine's class, a request checked (its question tokenized) once, rejected input counted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio

from specrag.controller.controller import RagController
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION, A, count_question_tokenizations, make_controller, scripted_index
from tests.helpers.engines import StandInSupervision, SupervisedSimulation


@pytest_asyncio.fixture(loop_scope="session")
async def supervised_service(
    tiny_assets: Assets,
) -> AsyncIterator[tuple[str, RagController, SupervisedSimulation]]:
    engine = SupervisedSimulation(StandInSupervision())
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    try:
        async with serving(create_app(controller), access_log=False) as url:
            yield url, controller, engine
    finally:
        await controller.close()
        await engine.close()


async def test_health_reports_any_engine_supervision(
    supervised_service: tuple[str, RagController, SupervisedSimulation],
) -> None:
    url, _, engine = supervised_service
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as response:
            assert response.status == 200
            body = await response.json()
        assert body["engine_state"] == "ready" and body["engine_restarts"] == 3
        assert body["last_recovery_s"] == 1.5 and body["prefill_pool"] == 0 and body["queued"] == 0
        await engine.die()
        async with http.get(f"{url}/health") as response:
            assert response.status == 503
            body = await response.json()
    assert body["status"] == "unavailable" and "died" in body["reason"] and body["engine_restarts"] == 3


async def test_the_service_checks_a_query_once(
    supervised_service: tuple[str, RagController, SupervisedSimulation],
) -> None:
    url, controller, _ = supervised_service
    seen = count_question_tokenizations(controller)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "k": 4, "max_tokens": 2}) as response:
            assert response.status == 200
        assert seen == [QUESTION]
        async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "session_id": "nope"}) as response:
            assert response.status == 404
        async with http.get(f"{url}/metrics") as response:
            metrics = await response.text()
    # A rejected request without a mode is counted under the core's default mode.
    assert f'specrag_requests_total{{mode="{controller.default_mode}",outcome="rejected"}} 1.0' in metrics
    assert 'specrag_requests_total{mode="all",outcome="ok"} 1.0' in metrics


async def test_a_penalty_the_engine_cannot_apply_is_a_400_naming_it(
    supervised_service: tuple[str, RagController, SupervisedSimulation],
) -> None:
    url, _, _ = supervised_service
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for path, body in (
            ("/v1/chat/completions", {**chat, "frequency_penalty": 0.5}),
            ("/v1/rag", {"query": QUESTION, "repetition_penalty": 1.2}),
        ):
            async with http.post(f"{url}{path}", json=body) as response:
                assert response.status == 400
                message = (await response.json())["error"]["message"]
            assert (
                message
                == f"{next(name for name in body if name.endswith('_penalty'))}: not supported by this engine"
            )
        # Neutral values ask for nothing the engine lacks.
        async with http.post(f"{url}/v1/chat/completions", json={**chat, "presence_penalty": 0}) as response:
            assert response.status == 200
