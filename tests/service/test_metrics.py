"""What the KV mirror missed is exported in /metrics, read at scrape time."""

from __future__ import annotations

from specrag.service.metrics import ServiceMetrics


def test_lost_kv_event_batches_and_callback_errors_are_exported() -> None:
    metrics = ServiceMetrics()
    missed = {"lost": 0, "errors": 0}
    metrics.watch_kv_mirror(lambda: missed["lost"], lambda: missed["errors"])
    missed.update(lost=3, errors=2)
    text = metrics.exposition().decode()
    assert "specrag_kv_event_batches_lost 3.0" in text
    assert "specrag_kv_event_callback_errors 2.0" in text
