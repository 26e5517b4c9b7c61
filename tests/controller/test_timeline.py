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
