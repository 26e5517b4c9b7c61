"""Speculation priced by its expected gain and cost: the arithmetic, the figures learned per index
and stage, and decisions on the simulated engine with set timings (a search much shorter than the
prefill, and one much longer)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrag.cache.pgdsf import PrefillProfile
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.controller import speculation_policy
from specrag.controller.controller import RagRequest
from specrag.controller.speculation_policy import EXPLORE_EVERY, Price, SpeculationPolicy, SpeculationSetting
from specrag.errors import InvalidInputError, check_choice
from specrag.retrieval.search.stage_stats import WINDOW, PlanKey, StageOutlook, StageStatistics
from specrag.retrieval.search.stages import Schedule, StageResult
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, B, make_controller, questions, scripted_index

# One second per 1000 prompt tokens, no fixed cost: prices that are easy to check by hand.
LINEAR = PrefillProfile([(0, 0.0), (1000, 1.0)])
KEY = PlanKey((("kind", "test"),), 4, 3, "equal")
STEP_TOKENS = 512


def policy(setting: str = "auto") -> SpeculationPolicy:
    return SpeculationPolicy(
        check_choice("speculation", setting, SpeculationSetting), PrefillEstimator(LINEAR), STEP_TOKENS
    )


def outlook(p_final: float, remaining_s: float) -> StageOutlook:
    return StageOutlook(p_final, p_final, remaining_s, 10)


def test_a_speculation_that_would_hide_little_search_is_priced_out() -> None:
    # r << 1: 10 ms of search left against a 500 ms prefill; even a likely top-k does not pay.
    price = policy().speculation(outlook(0.9, 0.010), True, 0, 500, waiting=0)
    assert price.gain_s == pytest.approx(0.9 * 0.010)
    assert price.cost_s == pytest.approx(0.1 * (0.5 - 0.010))
    assert not price.pays


def test_a_speculation_that_finishes_before_the_search_costs_nothing_on_an_idle_engine() -> None:
    # r > 1: a stale prompt's prefill ends before the search does and nobody waits behind it.
    price = policy().speculation(outlook(0.2, 1.0), True, 0, 500, waiting=0)
    assert price.cost_s == 0.0 and price.gain_s == pytest.approx(0.2 * 0.5)
    assert price.pays


def test_under_load_an_unlikely_top_k_is_held_back_and_a_likely_one_speculated() -> None:
    early = policy().speculation(outlook(0.3, 1.0), True, 0, 500, waiting=2)
    late = policy().speculation(outlook(0.9, 0.6), True, 0, 500, waiting=2)
    assert early.cost_s == pytest.approx(0.7 * 0.5 * 2) and not early.pays
    assert late.pays


def test_cached_tokens_make_the_speculation_cheaper_and_the_order_picks_the_chance() -> None:
    figures = StageOutlook(p_final_set=0.8, p_final_list=0.2, remaining_s=0.05, observed=5)
    ordered = policy().speculation(figures, True, 900, 100, waiting=0)
    in_retrieval_order = policy().speculation(figures, False, 900, 100, waiting=0)
    assert ordered.prefill_s == pytest.approx(0.1)
    assert ordered.p_final == 0.8 and in_retrieval_order.p_final == 0.2
    assert ordered.pays and not in_retrieval_order.pays


def test_an_early_guess_a_later_stage_often_replaces_waits_for_that_stage() -> None:
    # r near 1 (45 ms of search left, a 40 ms prefill): the first stage's top-k is final 6 times in
    # 10, the next stage's, 1 ms later, 8 in 10. A stale first guess holds the engine for its whole
    # step, so the next stage's speculation could hide almost nothing: waiting for it pays more.
    first = StageOutlook(0.6, 0.6, 0.045, 10, later=(outlook(0.8, 0.044),))
    price = policy().speculation(first, True, 0, 40, waiting=0)
    assert price.gain_s > price.cost_s and price.later_s == pytest.approx(0.8 * 0.040)
    assert not price.pays and price.deferred
    assert price.detail()["later_ms"] == pytest.approx(32.0)
    alone = policy().speculation(outlook(0.6, 0.045), True, 0, 40, waiting=0)  # no later stage known
    assert alone.pays and not alone.deferred and alone.later_s == 0.0
    likelier_now = StageOutlook(0.9, 0.9, 0.045, 10, later=(outlook(0.8, 0.044),))
    assert policy().speculation(likelier_now, True, 0, 40, waiting=0).pays


def test_the_shorter_the_engine_s_step_the_less_a_stale_guess_holds_up_its_replacement() -> None:
    # 600 ms left, a 500 ms prefill; later, 450 ms left at a stage final 9 times in 10. A stale
    # guess aborted then holds the engine to the end of its step: 350 more ms in one 500-token
    # step (the replacement hides 100 ms), 64 ms in 64-token steps (it hides 386 ms).
    first = StageOutlook(0.5, 0.5, 0.6, 10, later=(outlook(0.9, 0.45),))
    one_step = SpeculationPolicy(SpeculationSetting.AUTO, PrefillEstimator(LINEAR), 512)
    small_steps = SpeculationPolicy(SpeculationSetting.AUTO, PrefillEstimator(LINEAR), 64)
    held = one_step.speculation(first, True, 0, 500, waiting=0)
    brief = small_steps.speculation(first, True, 0, 500, waiting=0)
    assert held.gain_s == pytest.approx(0.5 * 0.5 + 0.4 * 0.1)
    assert brief.gain_s == pytest.approx(0.5 * 0.5 + 0.4 * 0.386)
    assert held.later_s == brief.later_s == pytest.approx(0.9 * 0.45 - 0.1 * 0.05)
    assert held.deferred and brief.pays


def test_a_warm_up_pays_when_the_search_left_exceeds_a_request_s_overhead() -> None:
    estimator = PrefillEstimator(LINEAR)
    estimator.overhead_s = 0.02
    warm = SpeculationPolicy(SpeculationSetting.AUTO, estimator, STEP_TOKENS)
    assert warm.warmup(outlook(0.0, 0.1), 300, waiting=0).pays  # gain 0.1 s, cost 0.02 s
    assert not warm.warmup(outlook(0.0, 0.01), 300, waiting=0).pays
    assert not warm.warmup(outlook(0.0, 0.1), 300, waiting=5).pays  # 6 requests pay the overhead


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="auto, always, never"):
        policy("sometimes")
    always = policy("always")
    assert always.for_query(True).speculates and always.for_query(True).pricing is None
    assert not policy("never").for_query(True).speculates
    assert not policy("auto").for_query(False).speculates


def stage(number: int, ids: list[int], done: bool, elapsed_s: float) -> StageResult:
    return StageResult(number, np.array(ids), np.zeros(len(ids), dtype=np.float32), done, elapsed_s)


def test_the_chance_a_stage_is_final_and_the_search_after_it_are_learned() -> None:
    stats = StageStatistics()
    before = stats.outlook(KEY, 1, elapsed_s=0.1)  # no search seen: 1/2, and this search's own pace
    assert before.observed == 0 and before.p_final_set == 0.5
    assert before.remaining_s == pytest.approx(0.1 * 2)  # equal stages: 1/3 done, 2/3 left
    for _ in range(8):  # stage 1 never final; stage 2 final as a set, but in another order
        stats.record(
            KEY, [stage(1, [1, 2], False, 0.1), stage(2, [4, 3], False, 0.2), stage(3, [3, 4], True, 0.3)]
        )
    first, second = stats.outlook(KEY, 1, 0.0), stats.outlook(KEY, 2, 0.0)
    assert first.observed == 8 and first.p_final_set == pytest.approx(1 / 10)
    assert second.p_final_set == pytest.approx(9 / 10) and second.p_final_list == pytest.approx(1 / 10)
    assert first.remaining_s == pytest.approx(0.5) and second.remaining_s == pytest.approx(0.3)
    assert first.later == (second,)  # stage 2 comes after stage 1; stage 3 was always the last
    assert second.later == ()
    assert [later.remaining_s for later in stats.outlook(KEY, 0, 0.0).later] == pytest.approx([0.5, 0.3])
    assert before.later == ()  # nothing learned: no later stage is known
    assert stats.outlook(KEY, 0, 0.0).remaining_s == pytest.approx(0.6)  # the whole search
    other = PlanKey(KEY.settings, 10, 3, Schedule.EQUAL)  # another k is another set of figures
    assert stats.outlook(other, 1, 0.0).observed == 0


def test_old_observations_fade_so_the_chance_follows_a_change() -> None:
    stats = StageStatistics()
    final = [stage(1, [1], False, 0.1), stage(2, [1], True, 0.1)]
    stale = [stage(1, [2], False, 0.1), stage(2, [1], True, 0.1)]
    for _ in range(2 * WINDOW):
        stats.record(KEY, final)
    for _ in range(WINDOW):
        stats.record(KEY, stale)
    assert stats.outlook(KEY, 1, 0.0).p_final_set < 0.5


async def test_a_speculation_is_skipped_when_its_price_says_so(tiny_assets: Assets) -> None:
    """Search of 3 ms a stage against a prefill of hundreds of ms (r << 1): never worth it."""
    engine = SimulatedEngine(time_scale=0.2, max_model_len=4096)
    index = scripted_index(tiny_assets, [A, B, B], 0.003)
    metrics = ServiceMetrics()
    for _ in range(3):
        # Cold each time (the engine's cache emptied, a new tree), so that every prefill stays long:
        # a cached prompt makes a speculation cheap enough to pay. The index keeps what it learned.
        await engine.reset_prefix_cache()
        controller = make_controller(engine, tiny_assets, index)
        done = await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=2))
        metrics.observe(done.timeline)
    timeline = done.timeline
    skips = [e for e in timeline.events if e.kind == "spec_skip"]
    assert timeline.speculations == 0 and timeline.speculations_priced_out == 2 == len(skips)
    assert all(e.detail["reason"] == "price" and e.detail["gain_ms"] <= e.detail["cost_ms"] for e in skips)
    assert skips[0].detail["observed"] == 2  # learned from the two searches before
    assert timeline.to_dict()["speculations_priced_out"] == 2
    text = metrics.exposition().decode()
    assert 'specrag_speculation_decisions_total{decision="price",kind="speculation"} 6.0' in text
    assert 'decision="launched",kind="speculation"' not in text
    await engine.close()


async def test_the_same_speculation_is_launched_when_it_pays(tiny_assets: Assets) -> None:
    """Search of 300 ms a stage against a prefill of a few ms (r >> 1): it pays, and is adopted."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [B, B, B], 0.3))
    metrics = ServiceMetrics()
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=2))
    metrics.observe(done.timeline)
    submits = [e for e in done.timeline.events if e.kind == "spec_submit"]
    assert len(submits) == 1 and done.timeline.adopted and done.timeline.speculations_priced_out == 0
    assert submits[0].detail["gain_ms"] > submits[0].detail["cost_ms"]
    text = metrics.exposition().decode()
    assert 'specrag_speculation_decisions_total{decision="launched",kind="speculation"} 1.0' in text
    await engine.close()


@pytest.mark.parametrize(("setting", "speculations"), [("always", 2), ("never", 0)])
async def test_always_speculates_unpriced_and_never_not_at_all(
    tiny_assets: Assets, setting: str, speculations: int
) -> None:
    engine = SimulatedEngine(time_scale=0.2, max_model_len=4096)
    index = scripted_index(tiny_assets, [A, B, B], 0.003)
    controller = make_controller(engine, tiny_assets, index, speculation=setting)
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="speculation", max_tokens=2))
    assert done.timeline.speculations == speculations and done.timeline.speculations_priced_out == 0
    assert all("gain_ms" not in e.detail for e in done.timeline.events)
    await engine.close()


async def test_a_warm_up_is_priced_by_the_search_it_can_hide(tiny_assets: Assets) -> None:
    """The first query knows no search time, so a warm-up could hide nothing: it is skipped. Once a
    search has taught the index its time, a cold system prompt is warmed beside the next search."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [B, B], 0.2))
    metrics = ServiceMetrics()
    first = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    skip = next(e for e in first.timeline.events if e.kind == "warmup_skip")
    assert skip.detail["gain_ms"] == 0 and skip.detail["observed"] == 0
    assert first.timeline.warmups_priced_out == 1 and not first.timeline.warmed
    await controller.reset_prefix_cache()
    second = await controller.answer(RagRequest(QUESTION, k=4, mode="warmup", max_tokens=2))
    start = next(e for e in second.timeline.events if e.kind == "warmup_start")
    assert start.detail["gain_ms"] > start.detail["cost_ms"] and start.detail["observed"] == 1
    assert second.timeline.warmed and controller.warmups.started == 1
    for done in (first, second):
        metrics.observe(done.timeline)
    text = metrics.exposition().decode()
    assert 'specrag_speculation_decisions_total{decision="price",kind="warmup"} 1.0' in text
    assert 'specrag_speculation_decisions_total{decision="launched",kind="warmup"} 1.0' in text
    await engine.close()


async def test_a_stage_that_waits_for_a_later_one_leaves_the_engine_to_that_one(
    tiny_assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first stage's speculation would pay, but the next stage's is expected to pay more: the
    first stage launches nothing, not even the cold system prompt's warm-up, whose prefill slot the
    next stage's speculation needs; that one is launched and adopted."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [B, B, B], 0.05))
    prices = iter(
        [Price(0.02, 0.0, 0.5, 0.1, 0.02, 0, 5, later_s=0.03), Price(0.03, 0.0, 0.9, 0.05, 0.02, 0, 5)]
    )
    monkeypatch.setattr(controller.speculation, "speculation", lambda *args, **kwargs: next(prices))
    done = await controller.answer(RagRequest(QUESTION, k=4, mode="all", max_tokens=2))
    decisions = [(e.kind, e.detail.get("stage"), e.detail.get("reason")) for e in done.timeline.events]
    assert ("spec_skip", 1, "later_stage") in decisions and ("spec_submit", 2, None) in decisions
    assert not any(kind.startswith("warmup") for kind, _, _ in decisions)
    assert done.timeline.adopted and done.timeline.speculations_priced_out == 1
    await engine.close()


def test_a_search_runs_in_one_stage_only_when_no_learned_stage_is_expected_to_pay() -> None:
    estimator = PrefillEstimator(LINEAR)
    unpriced = SpeculationPolicy(SpeculationSetting.AUTO, estimator, STEP_TOKENS)
    short = StageOutlook(1.0, 1.0, 0.020, 10, later=(outlook(0.3, 0.015), outlook(0.8, 0.005)))
    assert unpriced.unstaged(short, True, waiting=0) is None  # no answer served: no typical prompt
    estimator.record(0, 500, 0.5)  # a typical prompt: 500 tokens, 0.5 s to prefill
    # r << 1: 15 and 5 ms of search left against 0.5 s of prefill: no stage pays, one stage.
    price = unpriced.unstaged(short, True, waiting=0)
    assert price is not None and price.gain_s <= price.cost_s
    assert price == policy_prices_best(unpriced, short)
    # r >> 1: a stale prompt's prefill ends before the search does: stages.
    long = StageOutlook(1.0, 1.0, 2.0, 10, later=(outlook(0.3, 1.5), outlook(0.8, 1.0)))
    assert unpriced.unstaged(long, True, waiting=0) is None
    # A stage learned from too few searches: stages, to learn it.
    young = StageOutlook(1.0, 1.0, 0.020, 10, later=(outlook(0.3, 0.015), StageOutlook(0.8, 0.8, 0.005, 3)))
    assert unpriced.unstaged(young, True, waiting=0) is None


def policy_prices_best(policy: SpeculationPolicy, start: StageOutlook) -> Price:
    """The best of the start's stages priced one by one with the typical prompt (0 cached, 500
    computed), each with the stages after it as its later chances."""
    first, second = start.later
    prices = [
        policy.speculation(replace(first, later=(second,)), True, 0, 500, 0),
        policy.speculation(second, True, 0, 500, 0),
    ]
    return max(prices, key=lambda price: price.gain_s - price.cost_s)


def test_one_search_in_a_few_that_need_no_stages_still_runs_them_to_go_on_learning() -> None:
    estimator = PrefillEstimator(LINEAR)
    estimator.record(0, 500, 0.5)
    pricing = SpeculationPolicy(SpeculationSetting.AUTO, estimator, STEP_TOKENS)
    short = StageOutlook(1.0, 1.0, 0.020, 10, later=(outlook(0.3, 0.015), outlook(0.8, 0.005)))
    staged = [pricing.unstaged(short, True, waiting=0) is None for _ in range(3 * EXPLORE_EVERY)]
    assert [number for number, yes in enumerate(staged, start=1) if yes] == [
        EXPLORE_EVERY,
        2 * EXPLORE_EVERY,
        3 * EXPLORE_EVERY,
    ]
    always = SpeculationPolicy(SpeculationSetting.ALWAYS, estimator, STEP_TOKENS).for_query(True)
    assert always.unstaged(short, True, waiting=0) is None  # unpriced launches: stages as asked


async def test_a_search_whose_stages_cannot_pay_runs_in_one_stage_with_the_same_documents(
    tiny_assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real index's search of a few ms against a simulated prefill of hundreds (r << 1): once
    its stages were learned from, a query's search runs in one stage; its documents are those of
    the same question searched in stages."""
    monkeypatch.setattr(speculation_policy, "LEARNED_FROM", 2)
    fresh = learning_afresh(tiny_assets.index)
    engine = SimulatedEngine(time_scale=0.2, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, fresh)
    asked = questions(tiny_assets, 4)
    runs = []
    for question in asked:
        done = await controller.answer(RagRequest(question, k=4, mode="speculation", max_tokens=2))
        runs.append([event.kind for event in done.timeline.events])
    assert fresh.default_stages > 1 and all(
        kinds.count("stage") == fresh.default_stages for kinds in runs[:2]
    )
    assert "unstaged" in runs[3] and runs[3].count("stage") == 1
    last = done.timeline.documents
    staged = make_controller(engine, tiny_assets, learning_afresh(tiny_assets.index))
    again = await staged.answer(RagRequest(asked[3], k=4, mode="speculation", max_tokens=2))
    assert [event.kind for event in again.timeline.events].count("stage") == fresh.default_stages
    assert again.timeline.documents == last
    await engine.close()


def learning_afresh(index: VectorIndex) -> VectorIndex:
    """The same searcher with stage figures of its own (the shared index keeps what it learns)."""
    return VectorIndex(
        index.searcher, index.passage_ids, None, index.embedder, default_stages=index.default_stages
    )
