"""What the KV mirror missed and whether the prefill profile is measured are exported in /metrics,
read at scrape time."""

from __future__ import annotations

from specrag.controller.timeline import Timeline
from specrag.service.http.metrics import ServiceMetrics


def test_lost_kv_event_batches_and_callback_errors_are_exported() -> None:
    metrics = ServiceMetrics()
    missed = {"lost": 0, "errors": 0}
    metrics.watch_kv_mirror(lambda: missed["lost"], lambda: missed["errors"])
    missed.update(lost=3, errors=2)
    text = metrics.exposition().decode()
    assert "specrag_kv_event_batches_lost 3.0" in text
    assert "specrag_kv_event_callback_errors 2.0" in text


def test_whether_the_prefill_profile_is_measured_is_exported() -> None:
    metrics = ServiceMetrics()
    state = {"measured": False}
    metrics.watch_prefill_profile(lambda: state["measured"])
    assert "specrag_prefill_profile_measured 0.0" in metrics.exposition().decode()
    state["measured"] = True
    assert "specrag_prefill_profile_measured 1.0" in metrics.exposition().decode()


def test_each_querys_regime_r_is_a_histogram() -> None:
    metrics = ServiceMetrics()
    timeline = Timeline(arrival=0.0, mode="all")
    timeline.search_start, timeline.search_end = 0.1, 0.3  # a 200 ms search
    timeline.answer_submit, timeline.answer_scheduled = 0.15, 0.16
    timeline.answer_engine_first_token, timeline.first_token = 0.56, 0.57  # a 400 ms prefill
    metrics.observe(timeline)
    text = metrics.exposition().decode()
    assert 'specrag_regime_r_bucket{le="0.5"} 1.0' in text
    assert 'specrag_regime_r_bucket{le="0.25"} 0.0' in text
    assert "specrag_regime_r_count 1.0" in text


def test_predicted_cached_tokens_and_mispredictions_are_counted() -> None:
    metrics = ServiceMetrics()
    for predicted, delivered in ((32, 32), (48, 16), (0, 0)):
        timeline = Timeline(arrival=0.0, mode="all")
        timeline.predicted_cached_tokens, timeline.cached_prompt_tokens = predicted, delivered
        metrics.observe(timeline)
    text = metrics.exposition().decode()
    assert "specrag_predicted_cached_prompt_tokens_total 80.0" in text
    assert "specrag_cached_prompt_tokens_total 48.0" in text
    assert "specrag_cache_mispredictions_total 1.0" in text
