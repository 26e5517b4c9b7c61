"""Batch queries (:mod:`specrag.controller.batch`) on a simulated engine and the real index.

The answers come back in the order asked, each with its own timeline; the plan runs questions that
share documents one after the other, each once the one before it has its first token, so the later
one reuses the earlier one's prompt prefix; bad batches are refused before any work, and a failure
ends the whole batch with nothing left in the engine. The real engine's test is
tests/service/test_batch_api.py.
"""

from __future__ import annotations

import itertools

import pytest

from specrag.controller.controller import RagController, RagRequest
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, InvalidInputError, TooLargeError
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import pool_controller, simulated_pool

# Two pairs of questions, each pair retrieving the same passages, asked interleaved.
QUESTIONS = (
    "What does the assert statement do?",
    "How does asyncio.run create and close the event loop?",
    "What does the assert statement do exactly?",
    "How does asyncio.run create and close the event loop exactly?",
)


async def controller_and_pool(assets: Assets, **config: int) -> tuple[RagController, list[Replica]]:
    pool = simulated_pool(assets, 1)
    return pool_controller(pool, assets, assets.index, "specrag", **config), pool


async def close(controller: RagController, pool: list[Replica]) -> None:
    await controller.close()
    for replica in pool:
        await replica.engine.close()


def requests(questions: tuple[str, ...] = QUESTIONS, **options: object) -> list[RagRequest]:
    return [RagRequest(question, k=4, max_tokens=3, **options) for question in questions]  # type: ignore[arg-type]


async def test_answers_come_in_the_order_asked_and_run_in_the_plans_order(tiny_assets: Assets) -> None:
    controller, pool = await controller_and_pool(tiny_assets)
    result = await controller.answer_batch(requests(mode="ordering"))
    assert len(result.answers) == len(QUESTIONS)
    order = result.plan.order
    assert sorted(order) == list(range(len(QUESTIONS)))
    for number, answer in enumerate(result.answers):
        (planned,) = [event for event in answer.timeline.events if event.kind == "planned"]
        assert planned.detail["position"] == order.index(number)
        assert answer.timeline.documents and answer.text
    # The questions that share their passages run one after the other.
    for first, second in ((0, 2), (1, 3)):
        assert abs(order.index(first) - order.index(second)) == 1
    # Each query starts once the one before it in the schedule has its first token.
    timelines = [result.answers[number].timeline for number in order]
    for before, after in itertools.pairwise(timelines):
        assert before.first_token is not None and after.arrival >= before.first_token
    # The later of a pair reuses the earlier one's documents from the prefix cache.
    for first, second in ((0, 2), (1, 3)):
        earlier, later = sorted((first, second), key=order.index)
        assert result.answers[later].timeline.cached_prompt_tokens > (
            result.answers[earlier].timeline.cached_prompt_tokens
        )
    await close(controller, pool)


async def test_the_plan_says_each_questions_documents_in_prompt_order(tiny_assets: Assets) -> None:
    controller, pool = await controller_and_pool(tiny_assets)
    result = await controller.answer_batch(requests())
    store = controller.builder.store
    for number, answer in enumerate(result.answers):
        in_prompt = [store.passage(int(row)).id for row in answer.prompt.document_ids()]
        assert list(result.plan.documents[number]) == in_prompt
        assert sorted(in_prompt) == sorted(answer.timeline.documents)
    assert controller.in_flight_request_ids() == set()
    await close(controller, pool)


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        ([], InvalidInputError, "at least one question"),
        (requests() * 3, TooLargeError, "at most 8 questions, got 12"),
        ([RagRequest("", k=3)], InvalidInputError, r"queries\[0\]: the question is empty"),
        ([*requests()[:1], RagRequest("x", k=99)], InvalidInputError, r"queries\[1\]: k must be"),
        ([RagRequest("x", session_id="s")], InvalidInputError, "cannot continue a session"),
        (["a question"], InvalidInputError, r"queries\[0\]: expected a RagRequest, got str"),
    ],
)
async def test_a_bad_batch_is_refused_before_any_work(
    tiny_assets: Assets, batch: list[object], error: type[Exception], message: str
) -> None:
    controller, pool = await controller_and_pool(tiny_assets, max_batch_queries=8)
    with pytest.raises(error, match=message):
        await controller.answer_batch(batch)  # type: ignore[arg-type]
    engine = pool[0].engine
    assert isinstance(engine, SimulatedEngine) and engine.load().prefilling == 0
    await close(controller, pool)


async def test_a_failure_ends_the_whole_batch_and_leaves_nothing_in_the_engine(tiny_assets: Assets) -> None:
    controller, pool = await controller_and_pool(tiny_assets)
    engine = pool[0].engine
    assert isinstance(engine, SimulatedEngine)
    engine.fail_next(2, EngineError("injected"))  # the first query's request and its one retry
    with pytest.raises(EngineError, match="injected"):
        await controller.answer_batch(requests(mode="ordering"))  # no warm-up to take a failure
    assert controller.in_flight_request_ids() == set()
    await close(controller, pool)
