"""One query, one run: in-flight ids come from the live runs, a request is checked once, shared
warm-up work stays out of finished queries, supervision is asked of the engine. Simulated engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence

import pytest

from specrag.controller.controller import AnswerDelta, AnswerDone, RagRequest
from specrag.errors import InvalidInputError
from specrag.pipeline.engines.protocol import EngineCounts, EngineOutput, Sampling
from specrag.retrieval.search.stages import DEFAULT_STAGES
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import (
    QUESTION,
    A,
    B,
    count_question_tokenizations,
    make_controller,
    pool_controller,
    scripted_index,
    simulated_pool,
)
from tests.helpers.engines import HeldWarmEngine, StandInSupervision, SupervisedSimulation
from tests.helpers.waiting import assert_engine_idle, wait_until


class RecordingEngine(SimulatedEngine):
    """The simulated engine, remembering every request id submitted to it."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.05, max_model_len=4096)
        self.submitted: set[str] = set()

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        self.submitted.add(request_id)
        return super().generate(request_id, prompt_token_ids, sampling)


async def first_delta(stream: AsyncIterator[AnswerDelta | AnswerDone]) -> None:
    assert isinstance(await anext(stream), AnswerDelta)


def long_serial() -> RagRequest:
    """A query with one engine request that decodes long enough to be seen in flight."""
    return RagRequest(QUESTION, k=4, mode="serial", max_tokens=500)


async def test_in_flight_ids_are_those_of_the_live_queries(tiny_assets: Assets) -> None:
    engine = RecordingEngine()
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    first, second = controller.stream(long_serial()), controller.stream(long_serial())
    await first_delta(first)
    of_first = controller.in_flight_request_ids()
    assert len(of_first) == 1 and of_first <= engine.submitted
    await first_delta(second)
    both = controller.in_flight_request_ids()
    assert len(both) == 2 and of_first < both and both <= engine.submitted
    await first.aclose()  # leaving early: the first query's request goes, the second's stays
    assert controller.in_flight_request_ids() == both - of_first
    await second.aclose()
    assert controller.in_flight_request_ids() == set()
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_a_query_that_ends_or_is_closed_with_the_controller_leaves_no_id(tiny_assets: Assets) -> None:
    engine = RecordingEngine()
    index = scripted_index(tiny_assets, [A, B, B], 0.01)
    controller = make_controller(engine, tiny_assets, index, speculation="always")
    await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=4))
    assert controller.in_flight_request_ids() == set() and len(engine.submitted) >= 2
    stream = controller.stream(long_serial())
    await first_delta(stream)
    assert controller.in_flight_request_ids()
    await controller.close()
    assert controller.in_flight_request_ids() == set()
    await stream.aclose()
    await assert_engine_idle(engine, controller)
    await engine.close()


@pytest.mark.parametrize("checked_first", [True, False])
async def test_a_query_tokenizes_its_question_once(tiny_assets: Assets, checked_first: bool) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    # Three stages with a changing top-k: several speculative prompts and a final one are built.
    index = scripted_index(tiny_assets, [A, B, A], 0.01)
    controller = make_controller(engine, tiny_assets, index, speculation="always")
    seen = count_question_tokenizations(controller)
    request = RagRequest(QUESTION, k=4, mode="all", max_tokens=2)
    done = await controller.answer(controller.check(request) if checked_first else request)
    assert done.timeline.speculations >= 2
    assert seen == [QUESTION]
    await engine.close()


async def test_a_warm_up_that_outlives_its_query_is_recorded_by_the_controller(tiny_assets: Assets) -> None:
    engine = HeldWarmEngine()
    controller = make_controller(
        engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01), max_prefill_bs=2, speculation="always"
    )
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    events = list(done.timeline.events)
    assert done.timeline.warmed and [e.kind for e in events].count("warmup_start") == 1
    assert controller.warmups.started == 1 and controller.warmups.succeeded == 0

    engine.release_warm.set()
    await asyncio.wait_for(engine.warm_returned.wait(), 5)
    assert controller.warmups.succeeded == 1 and controller.warmups.last_cached_tokens is not None
    assert done.timeline.events == events and events[-1].kind == "done"
    assert controller.placement.replicas[0].tree.system_prompt_resident()
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_a_warm_up_on_a_hung_engine_gives_its_slot_back_at_the_first_token_deadline(
    tiny_assets: Assets,
) -> None:
    engine = HeldWarmEngine()  # its warm-up never ends unless released: a hung engine's
    controller = make_controller(
        engine,
        tiny_assets,
        scripted_index(tiny_assets, [A, A], 0.01),
        max_prefill_bs=2,
        speculation="always",
        first_token_timeout_s=0.3,
    )
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    assert done.timeline.warmed and controller.warmups.started == 1
    await wait_until(lambda: controller.warmups.failed == 1, 5.0)
    assert controller.gate.pool == 0  # its slot of the pool is back
    assert controller.warmups.succeeded == 0 and not engine.warm_returned.is_set()
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_a_failed_warm_up_is_counted_and_the_query_still_answers(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = scripted_index(tiny_assets, [A, A], 0.01)
    controller = make_controller(engine, tiny_assets, index, speculation="always")  # unpriced warm-up
    engine.fail_next(1)  # the first submission is the warm-up's
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    assert done.text and done.timeline.warmed
    assert controller.warmups.started == 1 and controller.warmups.failed == 1
    await engine.close()


async def test_the_controller_asks_the_engine_for_its_supervision(tiny_assets: Assets) -> None:
    supervision = StandInSupervision()
    engine = SupervisedSimulation(supervision)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    engine.fail_next(1)
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="serial", max_tokens=2))
    assert [e.kind for e in done.timeline.events].count("retry") == 1 and done.text
    assert supervision.reports == ["simulated engine: injected failure"] and supervision.waits == 1
    health = await controller.health()
    assert health.serving and health.supervision == supervision.status()
    await engine.close()
    assert not (await controller.health()).serving


class SilentCountsEngine(SimulatedEngine):
    """An engine being restarted: it takes requests but its counts never come."""

    async def counts(self) -> EngineCounts:
        await asyncio.Event().wait()
        raise AssertionError("unreachable: the event is never set")


async def test_health_answers_while_an_engine_does_not(
    tiny_assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("specrag.controller.controller.HEALTH_PROBE_TIMEOUT_S", 0.2)
    engine = SilentCountsEngine()
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    health = await asyncio.wait_for(controller.health(), 5)
    assert not health.serving and health.reason == "did not answer within 0.2 s"
    await engine.close()


class LateCachedCountEngine(SimulatedEngine):
    """Reports cached tokens only on the finishing output, as an OpenAI server does."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.05, max_model_len=4096)
        self.reported: list[int | None] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        async for output in super().generate(request_id, prompt_token_ids, sampling):
            if not output.finished:
                output = dataclasses.replace(output, cached_tokens=None)
            else:
                self.reported.append(output.cached_tokens)
            yield output


async def test_a_count_reported_only_at_the_end_reaches_the_timeline(
    tiny_assets: Assets, caplog: pytest.LogCaptureFixture
) -> None:
    engine = LateCachedCountEngine()
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A], 0.01))
    request = RagRequest(QUESTION, k=4, mode="serial", max_tokens=4)
    await controller.answer(request)
    with caplog.at_level(logging.DEBUG, logger="specrag.controller.run"):  # what `serve -v` shows
        repeated = await controller.answer(request)
    assert engine.reported[-1] and repeated.timeline.cached_prompt_tokens == engine.reported[-1]
    assert f"'cached_prompt_tokens': {engine.reported[-1]}" in caplog.text
    await controller.close()
    await engine.close()


async def test_a_final_request_preempts_another_querys_speculation(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.5, max_model_len=4096)  # prefills last long enough to be seen
    controller = make_controller(
        engine, tiny_assets, scripted_index(tiny_assets, [A, A, B, B]), max_prefill_bs=1
    )
    query = asyncio.create_task(
        controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=3))
    )
    await wait_until(lambda: any(r.startswith("spec-") for r in controller.in_flight_request_ids()))
    # Another query's final request needs the only slot: the speculation, still prefilling, gives it up.
    slot = await asyncio.wait_for(controller.gate.admit(cached_tokens=0, compute_tokens=500), 5.0)
    assert controller.gate.preemptions == 1
    await wait_until(lambda: not any(r.startswith("spec-") for r in controller.in_flight_request_ids()))
    slot.release()
    result = await query
    assert result.timeline.preempted_speculations == 1
    assert result.prompt.document_ids() == tuple(B)
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_an_adopted_speculation_is_never_preempted(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.5, max_model_len=4096)
    controller = make_controller(
        engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.05), max_prefill_bs=1, speculation="always"
    )
    query = asyncio.create_task(
        controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=3))
    )
    # Adopted: its request is still prefilling in the pool, but no longer counted as speculation.
    await wait_until(
        lambda: (
            any(r.startswith("spec-") for r in controller.in_flight_request_ids())
            and controller.gate.pool == 1
            and controller.gate.speculative_tokens == 0
        )
    )
    waiting = asyncio.create_task(controller.gate.admit(cached_tokens=0, compute_tokens=500))
    result = await query
    assert result.timeline.adopted and result.timeline.preempted_speculations == 0
    assert controller.gate.preemptions == 0
    (await asyncio.wait_for(waiting, 5.0)).release()
    await assert_engine_idle(engine, controller)
    await engine.close()


async def test_the_window_prefill_order_answers_every_query_from_its_own_documents(
    tiny_assets: Assets,
) -> None:
    engine = SimulatedEngine(time_scale=0.05, max_model_len=4096)
    index = scripted_index(tiny_assets, [B], 0.01)
    controller = make_controller(engine, tiny_assets, index, max_prefill_bs=1, prefill_order="window")
    requests = [RagRequest(QUESTION, k=4, mode="all", max_tokens=2) for _ in range(5)]
    results = await asyncio.gather(*(controller.answer(r) for r in requests))
    assert all(sorted(r.prompt.document_ids()) == sorted(B) for r in results)
    # The window had requests to choose from:
    assert any(event.kind == "queued" for r in results for event in r.timeline.events)
    await assert_engine_idle(engine, controller)
    await engine.close()


def test_the_window_prefill_order_needs_a_single_engine(tiny_assets: Assets) -> None:
    with pytest.raises(InvalidInputError, match="one replica"):
        pool_controller(
            simulated_pool(tiny_assets, 2), tiny_assets, tiny_assets.index, prefill_order="window"
        )


async def test_with_speculation_on_the_first_stage_speculates_instead_of_warming_up(
    tiny_assets: Assets,
) -> None:
    """A speculation prefills the system prompt with its documents; a warm-up started beside the
    search would hold the one prefill slot the first stage's speculation needs."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = scripted_index(tiny_assets, [A, A], 0.01)
    controller = make_controller(engine, tiny_assets, index, speculation="always")
    assert not controller.placement.replicas[0].tree.system_prompt_resident()
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="all", max_tokens=2))
    kinds = [e.kind for e in done.timeline.events]
    assert "spec_submit" in kinds and "warmup_start" not in kinds and done.timeline.adopted
    assert controller.warmups.started == 0 and controller.placement.replicas[0].tree.system_prompt_resident()
    await engine.close()


class ReportsWaiting(SimulatedEngine):
    """The simulated engine saying, as vLLM's scheduler figures would, that a request waits."""

    def _engine_waiting(self) -> int:
        return 1


async def test_a_stage_that_cannot_speculate_warms_the_system_prompt(tiny_assets: Assets) -> None:
    engine = ReportsWaiting(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="all", max_tokens=2))
    kinds = [e.kind for e in done.timeline.events]
    assert "spec_submit" not in kinds  # the engine had a waiting request: no speculation
    assert kinds.index("warmup_start") > kinds.index("stage")  # at the stage, not before
    assert controller.warmups.started == 1
    await engine.close()


@pytest.mark.parametrize(("configured", "mode"), [(None, "all"), (3, "speculation"), (None, "serial")])
async def test_a_query_searches_in_the_configured_stages_or_its_index_kinds(
    tiny_assets: Assets, configured: int | None, mode: str
) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, num_stages=configured)
    done = await controller.answer(RagRequest(QUESTION, k=4, mode=mode, max_tokens=2))
    stages = [e for e in done.timeline.events if e.kind == "stage"]
    expected = 1 if mode == "serial" else configured or tiny_assets.index.default_stages
    assert tiny_assets.index.default_stages == DEFAULT_STAGES["ivf"]
    assert len(stages) == expected and stages[-1].detail["done"]
    await engine.close()
