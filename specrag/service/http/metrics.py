"""Prometheus metrics of the service, computed from each query's timeline.

Every figure comes from the :class:`Timeline` the controller already records, so the metrics and
the per-request ``specrag`` object of the API can never disagree. The registry is a dedicated
:class:`CollectorRegistry` rather than the process-global one: several services (tests, benchmark
runs) can live in one process without "duplicated timeseries" errors. Gauges read the controller
at scrape time instead of being kept up to date by hand, so they cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from specrag.controller.modes import ModeName
from specrag.controller.timeline import Timeline
from specrag.controller.warmup import WarmupRecord
from specrag.errors import values

__all__ = [
    "DECISIONS",
    "LATENCY_BUCKETS_S",
    "OUTCOMES",
    "REGIME_BUCKETS",
    "ServiceMetrics",
    "mode_label",
]

# From a cached prompt on a GPU (milliseconds) to a cold long prompt on a small CPU box (tens of s).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# r = search / prefill on a log scale around 1, where overlap pays most.
REGIME_BUCKETS = (0.01, 0.03, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 10.0)

OUTCOMES = ("ok", "rejected", "overloaded", "error", "disconnected")

# Timeline events that record a speculative-prefill decision: (what was decided on, the decision).
DECISIONS = {
    "spec_submit": ("speculation", "launched"),
    "warmup_start": ("warmup", "launched"),
    "warmup_skip": ("warmup", "price"),
    "unstaged": ("stages", "price"),
}


def mode_label(mode: str | None, default: str) -> str:
    """A bounded label value: a client-chosen unknown mode must not create a new time series."""
    name = default if mode is None else mode
    return name if name in values(ModeName) else "invalid"


class _WarmupCollector(Collector):
    """System-prompt warm-ups by outcome, read from the controller's own record at each scrape.

    A warm-up is shared work that may outlive the query that started it, so it is counted where
    it is recorded, not from finished queries' timelines.
    """

    def __init__(self, record: Callable[[], WarmupRecord]) -> None:
        self._record = record

    def collect(self) -> Iterator[Metric]:
        record = self._record()
        family = CounterMetricFamily(
            "specrag_warmups",
            "System-prompt warm-ups, by outcome (started, succeeded, failed)",
            labels=["outcome"],
        )
        for outcome, count in (
            ("started", record.started),
            ("succeeded", record.succeeded),
            ("failed", record.failed),
        ):
            family.add_metric([outcome], count)
        yield family


class ServiceMetrics:
    """The service's metrics on their own registry; :meth:`observe` records one finished query."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)

        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, registry=self.registry, buckets=LATENCY_BUCKETS_S)

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, registry=self.registry)

        self.ttft = histogram("specrag_ttft_seconds", "Time from arrival to the first answer token")
        self.e2e = histogram("specrag_e2e_seconds", "Time from arrival to the end of the answer")
        self.embed = histogram("specrag_embed_seconds", "Embedding of the question (part of retrieval)")
        self.retrieval = histogram(
            "specrag_retrieval_seconds", "Question embedding plus staged vector search"
        )
        self.non_overlapped_retrieval = histogram(
            "specrag_non_overlapped_retrieval_seconds",
            "Retrieval time not overlapped by the answer's own prefill (from when the engine "
            "scheduled it where the engine reports that, else from its submission)",
        )
        self.queue_wait = histogram(
            "specrag_queue_wait_seconds", "Time the final prompt waited for a prefill slot"
        )
        self.regime_r = Histogram(
            "specrag_regime_r",
            "Each query's r: its retrieval time (embedding and search) over its answer's prefill "
            "time (overlap pays near 1)",
            registry=self.registry,
            buckets=REGIME_BUCKETS,
        )
        self.requests = counter("specrag_requests", "Queries by mode and outcome", ("mode", "outcome"))
        self.speculations = counter("specrag_speculations", "Speculative prefills submitted")
        self.aborted_speculations = counter("specrag_aborted_speculations", "Speculations aborted")
        self.preempted_speculations = counter(
            "specrag_preempted_speculations", "Speculations aborted because a final request needed their slot"
        )
        self.speculation_decisions = counter(
            "specrag_speculation_decisions",
            "Speculative prefill decisions of answered queries: speculations on a stage's top-k and "
            "system-prompt warm-ups, launched or skipped, and searches run in one stage (kind stages) "
            "(price: expected gain not above expected cost; no_room: the prefill gate refused; "
            "too_long: the prompt does not fit the model)",
            ("kind", "decision"),
        )
        self.adoptions = counter("specrag_adoptions", "Answers served by an adopted speculation")
        self.migrations = counter(
            "specrag_migrations",
            "Moves of an answer to another replica after its first token (its replica failed mid-answer)",
        )
        self.prompt_tokens = counter("specrag_prompt_tokens", "Prompt tokens of answered queries")
        self.cached_prompt_tokens = counter(
            "specrag_cached_prompt_tokens", "Prompt tokens the engine's prefix cache served"
        )
        self.predicted_cached_prompt_tokens = counter(
            "specrag_predicted_cached_prompt_tokens",
            "Prompt tokens the knowledge tree predicted the engine's prefix cache would serve",
        )
        self.cache_mispredictions = counter(
            "specrag_cache_mispredictions",
            "Answers whose predicted cached prompt tokens differ from those the engine served",
        )
        self.wasted_spec_prefill_tokens = counter(
            "specrag_wasted_spec_prefill_tokens", "Prompt tokens prefilled by aborted speculations"
        )
        # Replica names and reasons come from the service's own configuration and router, never
        # from a client: the label sets stay bounded.
        self.routed = counter(
            "specrag_routed", "Answers by the engine replica that served them and why", ("replica", "reason")
        )
        self.prefill_pool = Gauge(
            "specrag_prefill_pool",
            "Requests admitted and not yet at their first token",
            registry=self.registry,
        )
        self.queued = Gauge(
            "specrag_queued_requests", "Final requests waiting for a prefill slot", registry=self.registry
        )
        self.in_flight = Gauge("specrag_in_flight_queries", "Queries being answered", registry=self.registry)

    def watch(
        self,
        prefill_pool: Callable[[], float],
        queued: Callable[[], float],
        in_flight: Callable[[], float],
        warmups: Callable[[], WarmupRecord],
    ) -> None:
        """Read the gauges and the warm-up counters from these functions at every scrape."""
        self.prefill_pool.set_function(prefill_pool)
        self.queued.set_function(queued)
        self.in_flight.set_function(in_flight)
        self.registry.register(_WarmupCollector(warmups))

    def watch_kv_mirror(
        self, lost_batches: Callable[[], float], callback_errors: Callable[[], float]
    ) -> None:
        """Export what the KV mirror missed (read at every scrape): a drifting tree is visible."""
        for name, documentation, read in (
            ("specrag_kv_event_batches_lost", "KV event batches the tree never applied", lost_batches),
            (
                "specrag_kv_event_callback_errors",
                "KV event batches whose application failed",
                callback_errors,
            ),
        ):
            Gauge(name, documentation + " (since start)", registry=self.registry).set_function(read)

    def watch_prefill_profile(self, measured: Callable[[], bool]) -> None:
        """Export whether PGDSF's costs are measured on the engine in use yet (1) or the default (0)."""
        Gauge(
            "specrag_prefill_profile_measured",
            "1 when the knowledge tree's prefill profile is fitted on the engine in use, 0 for the default",
            registry=self.registry,
        ).set_function(lambda: float(measured()))

    def observe(self, timeline: Timeline) -> None:
        """Record a query that ran to the end of its answer."""
        self.requests.labels(mode=timeline.mode, outcome="ok").inc()
        for histogram, seconds in (
            (self.ttft, timeline.ttft_s),
            (self.e2e, None if timeline.done is None else timeline.done - timeline.arrival),
            (self.embed, timeline.embed_s),
            (self.retrieval, timeline.retrieval_s),
            (self.non_overlapped_retrieval, timeline.non_overlapped_retrieval_s),
            (self.queue_wait, timeline.queued_s),
        ):
            if seconds is not None:
                histogram.observe(seconds)
        if timeline.regime_r is not None:
            self.regime_r.observe(timeline.regime_r)
        self.speculations.inc(timeline.speculations)
        self.aborted_speculations.inc(timeline.aborted_speculations)
        self.preempted_speculations.inc(timeline.preempted_speculations)
        for event in timeline.events:
            decided = DECISIONS.get(event.kind)
            if event.kind == "spec_skip":
                decided = ("speculation", str(event.detail.get("reason")))
            if decided is not None:
                self.speculation_decisions.labels(kind=decided[0], decision=decided[1]).inc()
        self.adoptions.inc(int(timeline.adopted))
        self.migrations.inc(timeline.migrations)
        self.prompt_tokens.inc(timeline.prompt_tokens)
        self.cached_prompt_tokens.inc(timeline.cached_prompt_tokens)
        self.predicted_cached_prompt_tokens.inc(timeline.predicted_cached_tokens)
        self.cache_mispredictions.inc(int(timeline.predicted_cached_tokens != timeline.cached_prompt_tokens))
        self.wasted_spec_prefill_tokens.inc(timeline.wasted_spec_prefill_tokens)
        routes = [event for event in timeline.events if event.kind in ("route", "adopt")]
        if routes:  # the last one served the answer (an earlier one may have failed)
            last = routes[-1]
            reason = "adopted speculation" if last.kind == "adopt" else str(last.detail["reason"])
            self.routed.labels(replica=str(last.detail["replica"]), reason=reason).inc()

    def count_unfinished(self, mode: str, outcome: str, queries: int = 1) -> None:
        """Record queries that ended without an answer (their timelines stay inside the controller)."""
        if outcome not in OUTCOMES or outcome == "ok":
            raise ValueError(f"not an unfinished outcome: {outcome!r}")
        self.requests.labels(mode=mode, outcome=outcome).inc(queries)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
