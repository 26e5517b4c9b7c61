"""A follow-up turn is searched with its conversation; its prompt still continues the history.

On the real default index (the embedded corpus) and the simulated engine: "And which of its
methods adds the response header?" names no class; searched alone its passage is not in the top
10, joined with the turn before it (about ``http.server.BaseHTTPRequestHandler``) it is found
(bench.retrieval.conversations measures this over the whole multi-turn set).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from specrag.controller.controller import RagRequest
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller

FIRST = "What is the class `BaseHTTPRequestHandler` of the module `http.server` for?"
FOLLOW_UP = "And which of its methods adds the response header?"
ANSWERING = "doc/http.server#6"


@pytest_asyncio.fixture(loop_scope="session")
async def simulated() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=8192)
    yield engine
    await engine.close()


def ask(question: str, **options: object) -> RagRequest:
    return RagRequest(question, k=4, mode="serial", max_tokens=4, **options)  # type: ignore[arg-type]


async def test_the_follow_up_alone_misses_its_passage(
    simulated: SimulatedEngine, tiny_assets: Assets
) -> None:
    """What the service did before: the premise of the tests below."""
    controller = make_controller(simulated, tiny_assets)
    alone = await controller.answer(RagRequest(FOLLOW_UP, k=10, mode="serial", max_tokens=4))
    assert ANSWERING not in alone.timeline.documents


async def test_a_session_follow_up_is_searched_with_the_question_before_it(
    simulated: SimulatedEngine, tiny_assets: Assets
) -> None:
    controller = make_controller(simulated, tiny_assets)
    session_id = controller.create_session("test")
    first = await controller.answer(ask(FIRST, session_id=session_id, client="test"))
    assert not [event for event in first.timeline.events if event.kind == "conversation"]
    history = controller.sessions.get(session_id, "test").history
    follow_up = await controller.answer(ask(FOLLOW_UP, session_id=session_id, client="test"))
    assert ANSWERING in follow_up.timeline.documents
    (event,) = [event for event in follow_up.timeline.events if event.kind == "conversation"]
    assert event.detail["questions"] == 1
    # The prompt still continues the conversation token for token: the prefix cache serves it.
    assert follow_up.prompt.token_ids[: len(history)] == history


async def test_a_chat_follow_up_is_searched_with_the_earlier_user_messages(
    simulated: SimulatedEngine, tiny_assets: Assets
) -> None:
    controller = make_controller(simulated, tiny_assets)
    follow_up = await controller.answer(ask(FOLLOW_UP, previous_questions=(FIRST,)))
    assert ANSWERING in follow_up.timeline.documents
