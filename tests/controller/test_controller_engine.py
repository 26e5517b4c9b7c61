"""The controller on the real vLLM engine and on the simulated one: speculation, adoption, abort,
gate, warm-up, sessions. Every test runs on both; the simulated runs take milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio

from specrag.controller.controller import AnswerDelta, RagRequest
from specrag.errors import InvalidInputError, NotFoundError
from specrag.pipeline.engines.protocol import Engine
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, B, make_controller, run_conversation, scripted_index
from tests.helpers.waiting import assert_engine_idle, wait_until


@pytest_asyncio.fixture(loop_scope="session")
async def simulated_engine() -> AsyncIterator[SimulatedEngine]:
    """A fresh simulated engine with the tiny model's limits (fast: a twentieth of real time)."""
    simulated = SimulatedEngine(time_scale=0.05, max_model_len=4096)
    yield simulated
    await simulated.close()


@pytest.fixture(params=["simulated", pytest.param("vllm", marks=pytest.mark.engine)])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each test runs on the session's real vLLM engine and on the simulated engine."""
    chosen: Engine = request.getfixturevalue("vllm_engine" if request.param == "vllm" else "simulated_engine")
    return chosen


async def test_speculation_answers_from_the_serial_prompt(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets)
    serial = await controller.answer(RagRequest(QUESTION, k=6, mode="serial", max_tokens=6))
    speculative = await controller.answer(RagRequest(QUESTION, k=6, mode="speculation", max_tokens=6))
    assert speculative.prompt.token_ids == serial.prompt.token_ids
    assert speculative.text == serial.text
    assert serial.timeline.speculations == 0 and serial.timeline.documents == speculative.timeline.documents
    await assert_engine_idle(engine, controller)


@pytest.mark.engine
async def test_an_adopted_speculation_answers_as_serial_under_penalties(
    vllm_engine: Engine, tiny_assets: Assets
) -> None:
    """Penalties are a function of the prompt and the tokens so far: like greedy decoding, they
    give an adopted speculation the serial answer, token for token (the default's and a request's)."""
    controller = make_controller(
        vllm_engine, tiny_assets, scripted_index(tiny_assets, [A, A]), repetition_penalty=1.3
    )
    for asked in (RagRequest(QUESTION), RagRequest(QUESTION, frequency_penalty=0.5, presence_penalty=0.5)):
        serial = await controller.answer(replace(asked, k=4, mode="serial", max_tokens=12))
        speculative = await controller.answer(replace(asked, k=4, mode="speculation", max_tokens=12))
        assert speculative.timeline.adopted
        assert speculative.prompt.token_ids == serial.prompt.token_ids
        assert speculative.text == serial.text
    await assert_engine_idle(vllm_engine, controller)


async def test_a_speculation_on_the_final_list_is_adopted(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A, A, A]))
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=4))
    timeline = done.timeline
    assert timeline.adopted and timeline.speculations == 1 and timeline.aborted_speculations == 0
    assert [e.kind for e in timeline.events].count("final_submit") == 0
    # The answer's prefill started during the search: most of the search overlapped it.
    assert timeline.non_overlapped_retrieval_s is not None and timeline.retrieval_s is not None
    assert timeline.non_overlapped_retrieval_s < timeline.retrieval_s / 2
    await assert_engine_idle(engine, controller)


async def test_a_wrong_speculation_is_aborted_and_the_final_prompt_submitted(
    engine: Engine, tiny_assets: Assets
) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A, B]))
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=4))
    timeline = done.timeline
    assert not timeline.adopted
    assert timeline.speculations == 1 and timeline.aborted_speculations == 1
    assert [e.kind for e in timeline.events].count("final_submit") == 1
    assert done.prompt.document_ids() == tuple(B)
    # The shared first two documents were prefilled by the speculation: the final prompt reuses them.
    first_two_end = done.prompt.segments[2].end
    assert timeline.cached_prompt_tokens >= first_two_end // engine.block_size * engine.block_size
    await assert_engine_idle(engine, controller)


async def test_changed_candidates_replace_the_speculation(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, B, B]))
    timeline = (await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=4))).timeline
    assert timeline.speculations == 2 and timeline.aborted_speculations == 1 and timeline.adopted
    await assert_engine_idle(engine, controller)


async def test_a_closed_stream_leaves_no_request_behind(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, B, B, A]))
    stream = controller.stream(RagRequest(QUESTION, k=4, mode="all", max_tokens=500))
    async with contextlib.aclosing(stream):
        async for event in stream:
            assert isinstance(event, AnswerDelta)
            break
    await assert_engine_idle(engine, controller)


async def test_a_cancelled_query_leaves_no_request_behind(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, B, A, B, A]))
    task = asyncio.create_task(controller.answer(RagRequest(QUESTION, k=4, mode="all", max_tokens=500)))
    # Cancel mid-search (5 stages of 0.3 s), with a speculation in flight and no final request yet.
    await wait_until(lambda: any(r.startswith("spec-") for r in controller.in_flight_request_ids()))
    assert not any(r.startswith("final-") for r in controller.in_flight_request_ids())
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_engine_idle(engine, controller)


async def test_speculation_never_overfills_the_prefill_pool(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(
        engine,
        tiny_assets,
        scripted_index(tiny_assets, [A, B, A, B], stage_delay_s=0.1),
        max_prefill_bs=1,
    )
    requests = [RagRequest(QUESTION, k=4, mode="speculation", max_tokens=3) for _ in range(4)]
    results = await asyncio.gather(*(controller.answer(r) for r in requests))
    assert controller.gate.peak_pool == 1
    assert all(r.prompt.document_ids() == tuple(B) for r in results)
    await assert_engine_idle(engine, controller)


async def test_warm_up_runs_only_when_the_system_prompt_is_cold(engine: Engine, tiny_assets: Assets) -> None:
    await engine.reset_prefix_cache()
    index = scripted_index(tiny_assets, [A, A])
    controller = make_controller(engine, tiny_assets, index, speculation="always")  # unpriced warm-up
    assert not controller.placement.replicas[0].tree.system_prompt_resident()
    first = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    assert first.timeline.warmed
    assert controller.placement.replicas[0].tree.system_prompt_resident()
    second = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    assert not second.timeline.warmed
    await assert_engine_idle(engine, controller)


async def test_a_session_continues_the_previous_turn_and_drops_repeated_documents(
    engine: Engine, tiny_assets: Assets
) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], stage_delay_s=0.01))
    session = controller.sessions.create("test")
    first = await controller.answer(
        RagRequest(QUESTION, k=4, max_tokens=4, session_id=session.session_id, client="test")
    )
    controller.index = scripted_index(tiny_assets, [B, B], stage_delay_s=0.01)
    second = await controller.answer(
        RagRequest("And how is it closed?", k=4, max_tokens=4, session_id=session.session_id, client="test")
    )
    history = session.history
    assert second.prompt.token_ids[: len(first.prompt.token_ids)] == first.prompt.token_ids
    assert set(second.prompt.document_ids()) == set(B) - set(A)
    assert history[: len(second.prompt.token_ids)] == second.prompt.token_ids
    assert (
        second.timeline.cached_prompt_tokens
        >= len(first.prompt.token_ids) // engine.block_size * engine.block_size - engine.block_size
    )
    await assert_engine_idle(engine, controller)


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (RagRequest("  "), InvalidInputError, "question is empty"),
        (RagRequest(QUESTION, k=0), InvalidInputError, "k must be an integer between 1 and"),
        (RagRequest(QUESTION, k=51), InvalidInputError, "k must be an integer between 1 and"),
        (RagRequest(QUESTION, mode="turbo"), InvalidInputError, "unknown mode 'turbo'"),
        (RagRequest(QUESTION, max_tokens=0), InvalidInputError, "max_tokens must be between"),
        (RagRequest(QUESTION, session_id="nope"), NotFoundError, "unknown session 'nope'"),
        (RagRequest("x" * 5000), InvalidInputError, "longer than"),
        (RagRequest(QUESTION, k=50, mode="serial"), InvalidInputError, "exceeds the model's limit"),
    ],
)
async def test_bad_requests_are_rejected_with_a_clear_error(
    engine: Engine, tiny_assets: Assets, request_: RagRequest, error: type[Exception], message: str
) -> None:
    controller = make_controller(engine, tiny_assets)
    with pytest.raises(error, match=message):
        await controller.answer(request_)
    await assert_engine_idle(engine, controller)


async def test_a_stop_string_ends_the_answer_before_it(engine: Engine, tiny_assets: Assets) -> None:
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], stage_delay_s=0.01))
    whole = await controller.answer(RagRequest(QUESTION, k=4, mode="serial", max_tokens=24))
    middle = len(whole.text) // 2
    stop = whole.text[middle : middle + 2]
    stopped = await controller.answer(RagRequest(QUESTION, k=4, mode="serial", max_tokens=24, stop=[stop]))
    assert (stopped.text, stopped.finish_reason) == (whole.text[: whole.text.index(stop)], "stop")
    await assert_engine_idle(engine, controller)


async def test_a_conversation_at_the_defaults_stays_inside_the_context(
    engine: Engine, tiny_assets: Assets
) -> None:
    """The defaults' proportions on the test model's 4k context (k = 5 where the 8k default has 10,
    64 output tokens): 20 turns outgrow the context many times over, and none fails."""
    controller = make_controller(engine, tiny_assets)
    answers = await run_conversation(controller, 20, tiny_assets, k=5)
    assert sum(done.timeline.dropped_turns for done in answers) > 0
    assert all(len(done.prompt.token_ids) + 64 <= engine.max_model_len for done in answers)
    await assert_engine_idle(engine, controller)


async def test_a_follow_up_is_searched_with_its_conversation_and_still_continues_its_prompt(
    engine: Engine, tiny_assets: Assets
) -> None:
    """A follow-up on the real index (and, with the engine mark, real vLLM's prefix cache):
    tests/controller/test_conversational_retrieval.py says why this pair."""
    controller = make_controller(engine, tiny_assets)
    session = controller.sessions.create("test")
    first = await controller.answer(
        RagRequest(
            "What is the class `BaseHTTPRequestHandler` of the module `http.server` for?",
            k=4,
            max_tokens=4,
            session_id=session.session_id,
            client="test",
        )
    )
    second = await controller.answer(
        RagRequest(
            "And which of its methods adds the response header?",
            k=4,
            max_tokens=4,
            session_id=session.session_id,
            client="test",
        )
    )
    assert "doc/http.server#6" in second.timeline.documents
    assert [event.kind for event in second.timeline.events].count("conversation") == 1
    assert second.prompt.token_ids[: len(first.prompt.token_ids)] == first.prompt.token_ids
    assert (
        second.timeline.cached_prompt_tokens
        >= len(first.prompt.token_ids) // engine.block_size * engine.block_size - engine.block_size
    )
    await assert_engine_idle(engine, controller)
