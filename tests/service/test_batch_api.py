"""``POST /v1/rag/batch``, :meth:`AsyncClient.batch` and ``specrag batch`` on the real engine.

The session's vLLM engine (the tiny model) over the embedded default corpus and index: eight
questions come back in the order asked, each with its timeline and its question; the plan says the
order they ran in; a batch beyond the bound is 413 and a malformed one 400, before any work.
Marked ``engine``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from specrag.cli import main
from specrag.client import AsyncClient, SpecragHTTPError
from specrag.controller.controller import RagController
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.run.assets import Assets
from tests.helpers.builders import make_controller
from tests.helpers.http import metric, running
from tests.helpers.waiting import assert_engine_idle

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

QUESTIONS = [
    "What does the assert statement do?",
    "How does asyncio.run create and close the event loop?",
    "How can I create a temporary directory that is removed automatically?",
    "What does the assert statement do when optimizations are on?",
    "How do I read a JSON file into a dictionary?",
    "How does asyncio.run close the event loop at the end?",
    "How do I create a temporary directory that goes away by itself?",
    "How do I write a dictionary to a JSON file?",
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def service(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[tuple[str, RagController]]:
    controller = make_controller(vllm_engine, tiny_assets)
    async with running(controller) as url:
        yield url, controller


async def test_eight_questions_come_back_in_the_order_asked_with_their_timelines(
    service: tuple[str, RagController], vllm_engine: VllmEngine
) -> None:
    url, controller = service
    async with AsyncClient(url) as client:
        result = await client.batch(QUESTIONS, k=4, max_tokens=4)
        metrics = await client.metrics_text()
    assert result.queries == QUESTIONS and len(result.answers) == len(QUESTIONS)
    order = result.plan["order"]
    assert sorted(order) == list(range(len(QUESTIONS)))
    for number, answer in enumerate(result.answers):
        timeline = answer.timeline
        assert timeline["ttft_ms"] > 0 and timeline["prompt_tokens"] > 0 and answer.documents
        (planned,) = [event for event in timeline["events"] if event["kind"] == "planned"]
        assert planned["position"] == order.index(number)
        assert sorted(result.plan["documents"][number]) == sorted(answer.documents)
    assert result.plan["retrieval_ms"] > 0 and result.plan["planning_ms"] >= 0
    # Questions on one topic share passages: the later ones reuse the earlier ones' prefix.
    assert sum(answer.timeline["cached_prompt_tokens"] for answer in result.answers) > 0
    assert metric(metrics, "specrag_requests_total", mode="all", outcome="ok") >= len(QUESTIONS)
    await assert_engine_idle(vllm_engine, controller)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"queries": ["q"] * 33}, 413, "at most 32 questions, got 33"),
        ({"queries": ["q"] * 65}, 413, "at most 64 questions here"),
        ({"queries": []}, 400, "at least one question"),
        ({"queries": "a question"}, 400, "'queries' must be a list"),
        ({"queries": ["ok", 3]}, 400, "'queries' must be a list of strings"),
        ({"queries": ["ok", " "]}, 400, r"queries[1]: the question is empty"),
        ({"queries": ["ok"], "k": 0}, 400, "k must be an integer between 1 and 50"),
        ({"queries": ["ok"], "session_id": "s"}, 400, "unknown fields: session_id"),
        ({"query": "ok"}, 400, "unknown fields: query"),
    ],
)
async def test_a_bad_batch_gets_its_4xx(
    service: tuple[str, RagController], body: dict[str, object], status: int, message: str
) -> None:
    url, _ = service
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/rag/batch", json=body) as response:
        assert response.status == status
        assert message in (await response.json())["error"]["message"]


async def test_the_client_raises_the_services_error(service: tuple[str, RagController]) -> None:
    url, _ = service
    async with AsyncClient(url) as client:
        with pytest.raises(SpecragHTTPError) as raised:
            await client.batch(["q"] * 33)
        with pytest.raises(TypeError, match="not one string"):
            await client.batch("one question")
    assert raised.value.status == 413 and raised.value.code == "too_large"


async def test_the_cli_answers_a_file_of_questions_in_file_order(
    service: tuple[str, RagController], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = service
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(QUESTIONS[:5]) + "\n\n")
    argv = ["batch", str(questions), "--url", url, "--batch-size", "3", "-k", "3", "--max-tokens", "2"]
    assert await asyncio.to_thread(main, argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["query"] for line in lines] == QUESTIONS[:5]
    assert [line["batch"] for line in lines] == [0, 0, 0, 1, 1]
    assert sorted(line["ran_at"] for line in lines[:3]) == [0, 1, 2]
    assert all(line["specrag"]["ttft_ms"] > 0 for line in lines)
    for line in lines:  # the passages' ids and titles, as /v1/rag gives them
        assert sorted(source["id"] for source in line["sources"]) == sorted(line["documents"])
