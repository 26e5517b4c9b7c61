"""Conversations that survive failure: a session changes only when a turn is recorded,
runs one turn at a time, stays inside the model's context, and is bounded per client. The store
is tested alone; the controller on the simulated engine (the real engine: test_controller_engine)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from specrag.controller.controller import AnswerDelta, AnswerDone, RagController, RagRequest
from specrag.controller.sessions import SessionStore
from specrag.errors import ConflictError, EngineError, NotFoundError, OverloadedError
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, B, Clock, make_controller, run_conversation, scripted_index
from tests.helpers.waiting import assert_engine_idle

SECOND = "And how is the loop closed?"


# ------------------------------------------------------------------------------------ the store


def test_a_client_past_its_bound_replaces_its_own_oldest_idle_session() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=100, max_per_client=3, clock=clock)
    other = store.create("10.0.0.2")
    mine = []
    for _ in range(1000):
        clock.now += 1
        mine.append(store.create("10.0.0.1"))
    assert store.owned_by("10.0.0.1") == 3 and len(store) == 4
    assert store.get(other.session_id, "10.0.0.2") is other  # another client's session is never pushed out
    with pytest.raises(NotFoundError):
        store.get(mine[0].session_id, "10.0.0.1")


def test_a_session_with_a_turn_in_progress_is_never_evicted() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=100, max_per_client=2, clock=clock)
    busy = store.create("a")
    store.begin_turn(busy)
    idle = store.create("a")
    clock.now += 1
    store.create("a")
    assert store.get(busy.session_id, "a") is busy
    with pytest.raises(NotFoundError):
        store.get(idle.session_id, "a")
    store.begin_turn(store.create("a"))
    with pytest.raises(OverloadedError, match="each with a turn in progress"):
        store.create("a")


def test_past_the_global_bound_a_new_session_waits_for_the_oldest_to_expire() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=3, max_per_client=3, ttl_s=100, clock=clock)
    first, second, third = (store.create(client) for client in "abc")
    clock.now += 30
    store.get(first.session_id, "a")  # used: now the most recent; second is the oldest idle one
    with pytest.raises(OverloadedError, match="3 sessions are open") as refused:
        store.create("d")
    assert refused.value.retry_after_s == 70  # when second expires
    assert [store.get(s.session_id, s.owner) for s in (first, second, third)] == [first, second, third]
    clock.now += 101  # all three idle past the timeout: expired, room again
    store.create("d")
    assert len(store) == 1


def test_expiry_skips_a_session_whose_turn_runs() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=10, clock=clock)
    busy, idle = store.create("a"), store.create("a")
    store.begin_turn(busy)
    clock.now += 11
    assert store.get(busy.session_id, "a") is busy
    with pytest.raises(NotFoundError):
        store.get(idle.session_id, "a")


def test_echoed_session_ids_are_cut_short() -> None:
    with pytest.raises(NotFoundError) as raised:
        SessionStore().get("x" * 10_000, "a")
    assert len(str(raised.value)) < 200 and "10,002 characters" in str(raised.value)


# ------------------------------------------------------------------------------- the controller


@pytest_asyncio.fixture(loop_scope="session")
async def simulated() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    yield engine
    await engine.close()


def turn(question: str, session_id: str, max_tokens: int = 4) -> RagRequest:
    return RagRequest(
        question, k=4, mode="serial", max_tokens=max_tokens, session_id=session_id, client="test"
    )


async def two_sessions_after_a_first_turn(controller: RagController) -> tuple[str, str]:
    """Two sessions with the same first turn (documents A); the next turns retrieve B."""
    sessions = controller.create_session("test"), controller.create_session("test")
    for session_id in sessions:
        await controller.answer(turn(QUESTION, session_id))
    return sessions


async def fail(controller: RagController, engine: SimulatedEngine, session_id: str) -> None:
    engine.fail_next(2)  # the turn and its one retry
    with pytest.raises(EngineError):
        await controller.answer(turn(SECOND, session_id))


async def abandon(controller: RagController, engine: SimulatedEngine, session_id: str) -> None:
    async with contextlib.aclosing(controller.stream(turn(SECOND, session_id, max_tokens=200))) as stream:
        assert isinstance(await anext(stream), AnswerDelta)  # the client leaves mid-answer


@pytest.mark.parametrize("end_early", [fail, abandon])
async def test_a_failed_or_abandoned_turn_leaves_the_session_as_it_was(
    end_early: Callable[[RagController, SimulatedEngine, str], Awaitable[None]],
    simulated: SimulatedEngine,
    tiny_assets: Assets,
) -> None:
    controller = make_controller(simulated, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    fresh, ended = await two_sessions_after_a_first_turn(controller)
    controller.index = scripted_index(tiny_assets, [B, B], 0.01)
    await end_early(controller, simulated, ended)
    assert controller.sessions.get(ended, "test").turns == 1
    retried = await controller.answer(turn(SECOND, ended))
    expected = await controller.answer(turn(SECOND, fresh))
    assert retried.prompt.token_ids == expected.prompt.token_ids
    assert set(retried.prompt.document_ids()) == set(B) - set(A)
    assert controller.sessions.get(ended, "test").turns == 2
    await assert_engine_idle(simulated, controller)


async def test_a_second_turn_while_one_runs_is_refused(
    simulated: SimulatedEngine, tiny_assets: Assets
) -> None:
    controller = make_controller(simulated, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    session_id = controller.create_session("test")
    first, second = controller.check(turn(QUESTION, session_id)), controller.check(turn(SECOND, session_id))
    async with contextlib.aclosing(controller.stream(turn(QUESTION, session_id, max_tokens=200))) as running:
        assert isinstance(await anext(running), AnswerDelta)
        with pytest.raises(ConflictError, match="has a turn in progress"):
            controller.check(turn(SECOND, session_id))
        with pytest.raises(ConflictError):
            await controller.answer(second)  # checked before the first began: refused when it runs
    done = await controller.answer(first)  # the session is free again
    assert isinstance(done, AnswerDone) and controller.sessions.get(session_id, "test").turns == 1
    await assert_engine_idle(simulated, controller)


async def test_a_conversation_at_the_defaults_runs_twenty_turns(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.001)  # the default 8k context
    controller = make_controller(engine, tiny_assets)
    answers = await run_conversation(controller, 20, tiny_assets)
    limit = engine.max_model_len - controller.config.max_tokens_default
    assert all(len(done.prompt.token_ids) <= limit for done in answers)
    dropped = [done.timeline for done in answers if done.timeline.dropped_turns]
    assert dropped, "20 turns of 10 documents outgrow 8k tokens: old turns must have been dropped"
    event = next(e for e in dropped[0].events if e.kind == "history_dropped")
    assert event.detail["turns"][0] == 1 and event.detail["tokens"] > 0
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_a_running_top_k_too_long_for_the_model_is_not_speculated_on(tiny_assets: Assets) -> None:
    by_length = sorted(range(len(tiny_assets.passages)), key=lambda row: len(tiny_assets.store.tokens(row)))
    short, long = by_length[:6], by_length[-6:]
    builder = PromptBuilder(tiny_assets.tokenizer, tiny_assets.store, block_size=32)
    final_tokens = len(builder.build(short, QUESTION, hint="x" * 200).token_ids)
    assert len(builder.build(long, QUESTION).token_ids) > final_tokens + 200
    engine = SimulatedEngine(time_scale=0.01, max_model_len=final_tokens + 4 + 100)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [long, short], 0.01))
    for mode in ("speculation", "all"):
        done = await controller.answer(RagRequest(QUESTION, k=6, mode=mode, max_tokens=4))
        assert done.prompt.document_ids() and set(done.prompt.document_ids()) == set(short)
        assert [e.kind for e in done.timeline.events].count("spec_skip") == 1
        assert done.timeline.speculations == 0
    await assert_engine_idle(engine, controller)
    await engine.close()
