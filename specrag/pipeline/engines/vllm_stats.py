"""What vLLM reports about its scheduler and each request, read through its public hooks.

The scheduler's figures arrive through a stat logger (vLLM's extension point for metrics, given
to ``AsyncLLM`` at start), a request's stamps on its outputs: neither needs vLLM patched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SchedulerSnapshot", "engine_stamp", "scheduled_at", "stat_logger_factory"]


@dataclass
class SchedulerSnapshot:
    """The latest scheduler figures vLLM reported, plus prefix-cache hit totals since start."""

    running: int = 0
    waiting: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def stat_logger_factory(snapshot: SchedulerSnapshot) -> Any:
    """A vLLM stat logger that copies scheduler stats into ``snapshot`` (and logs nothing)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.snapshot = snapshot

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            self.snapshot.running = scheduler_stats.num_running_reqs
            self.snapshot.waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            self.snapshot.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
            self.snapshot.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits

        def log_engine_initialized(self) -> None:
            return None

    return SnapshotLogger


def scheduled_at(output: Any) -> float | None:
    """When vLLM's scheduler first gave the request a step, on our clock; None before it did."""
    return engine_stamp(output, "scheduled_ts")


def engine_stamp(output: Any, name: str) -> float | None:
    """One of vLLM's per-request stamps (``queued_ts``, ``scheduled_ts``, ``last_token_ts``: the
    latest output's step) on our clock; None when it has not happened or is not reported.

    vLLM's engine core stamps its request events and output batches with ``time.monotonic()`` in
    its own process; on Linux that is CLOCK_MONOTONIC, the clock ``time.perf_counter()`` reads
    here too (both system-wide), so the stamps compare directly with our timelines. The
    statistics exist only with vLLM's stat logging on, which the in-process engine turns on
    (:mod:`specrag.pipeline.engines.vllm_engine`).
    """
    metrics = getattr(output, "metrics", None)
    stamp = getattr(metrics, name, 0.0) if metrics is not None else 0.0
    return float(stamp) if stamp else None
