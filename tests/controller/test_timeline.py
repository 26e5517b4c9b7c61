"""The timeline's derived figures: retrieval counts the embedding, non-overlap says its basis."""

from __future__ import annotations

import pytest

from specrag.controller.timeline import Timeline


def _timeline(scheduled: float | None) -> Timeline:
    timeline = Timeline(arrival=0.0, mode="all")
    timeline.embed_start, timeline.search_start, timeline.search_end = 1.0, 1.5, 4.0
    timeline.answer_submit, timeline.answer_scheduled = 2.0, scheduled
    return timeline


def test_retrieval_starts_with_the_embedding() -> None:
    timeline = _timeline(None)
    assert timeline.embed_s == pytest.approx(0.5)
    assert timeline.retrieval_s == pytest.approx(3.0)


def test_non_overlap_runs_to_when_the_engine_scheduled_the_answer() -> None:
    timeline = _timeline(3.0)  # submitted at 2.0, waited in the engine's queue until 3.0
    assert timeline.non_overlapped_basis == "engine_scheduled"
    assert timeline.non_overlapped_retrieval_s == pytest.approx(2.0)
    assert timeline.non_overlapped_retrieval_submitted_s == pytest.approx(1.0)


def test_without_the_engines_stamp_the_submission_is_the_basis_and_says_so() -> None:
    timeline = _timeline(None)
    assert timeline.non_overlapped_basis == "submitted"
    assert timeline.non_overlapped_retrieval_s == pytest.approx(1.0)
    assert timeline.to_dict()["non_overlapped_basis"] == "submitted"


def test_non_overlap_never_exceeds_retrieval() -> None:
    timeline = _timeline(9.0)  # scheduled after the search ended
    assert timeline.non_overlapped_retrieval_s == pytest.approx(timeline.retrieval_s)


def test_phases_split_the_answers_way_to_its_first_token_step_by_step() -> None:
    timeline = _timeline(3.0)  # an adopted speculation: submitted at 2.0, before the search's end
    timeline.answer_queued, timeline.answer_engine_first_token = 2.5, 5.0
    timeline.answer_received, timeline.first_token = 5.25, 6.0
    timeline.answer_beside = {"prefilling": 1, "decoding": 0, "engine_waiting": 0}
    timeline.add("spec_abort", 1.75, reason="stale")
    timeline.add("spec_abort", 7.0, reason="stale")  # after the answer's submission: not before it
    phases = timeline.to_dict()["phases"]
    assert phases["search_end_to_submit_ms"] == pytest.approx(-2000.0)
    assert phases["submit_to_queued_ms"] == pytest.approx(500.0)
    assert phases["queued_to_scheduled_ms"] == pytest.approx(500.0)
    assert phases["scheduled_to_engine_first_token_ms"] == pytest.approx(2000.0)
    assert phases["engine_to_received_ms"] == pytest.approx(250.0)
    assert phases["received_to_seen_ms"] == pytest.approx(750.0)
    assert phases["beside_at_submit"] == {"prefilling": 1, "decoding": 0, "engine_waiting": 0}
    assert phases["aborted_before_submit"] == 1


def test_a_phase_the_engine_does_not_stamp_is_unknown_not_zero() -> None:
    phases = _timeline(None).phases  # an engine without per-request statistics
    assert phases["submit_to_queued_ms"] is None
    assert phases["queued_to_scheduled_ms"] is None
    assert phases["search_end_to_submit_ms"] == pytest.approx(-2000.0)


def test_r_is_the_retrieval_over_the_answers_prefill_as_the_engine_ran_it() -> None:
    """Retrieval: the question's embedding (1.0 -> 1.5) and the search (1.5 -> 4.0)."""
    timeline = _timeline(3.0)  # the engine scheduled the answer at 3.0
    timeline.answer_engine_first_token, timeline.first_token = 8.0, 8.5
    assert timeline.embed_s == pytest.approx(0.5) and timeline.search_s == pytest.approx(2.5)
    assert timeline.answer_prefill_s == pytest.approx(5.0)
    assert timeline.to_dict()["regime_r"] == pytest.approx(0.6)
    assert timeline.to_dict()["embed_ms"] == pytest.approx(500.0)


def test_r_is_unknown_without_a_search_or_a_first_token() -> None:
    no_token = _timeline(3.0)
    assert no_token.regime_r is None and no_token.to_dict()["regime_r"] is None
    batch = Timeline(arrival=0.0, mode="all")  # a batch query: its batch searched for it
    batch.answer_submit, batch.first_token = 0.1, 0.5
    assert batch.answer_prefill_s == pytest.approx(0.4) and batch.regime_r is None
