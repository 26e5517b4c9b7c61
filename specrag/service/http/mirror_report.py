"""How each replica's KV mirror stands, for ``/metrics`` and ``/health``.

A mirror that drifted from the engine's cache mispredicts cached tokens and misorders documents
without failing anything, so its state is exported rather than only logged: per replica whether
it is exact (1) or degraded (0), how far it is behind the events received (its lag: a mirror that
falls behind predicts from an older cache) and the counters of what the event stream did
(docs/ordering.md).
Everything is read from the mirrors at scrape time, so it cannot drift from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specrag.pipeline.kv_mirror.mirror import KVMirror

__all__ = ["MIRROR_HEALTH", "MirrorCollector", "MirrorHealth", "mirror_health"]

MirrorHealth = Callable[[], Mapping[str, Mapping[str, object]]]
MIRROR_HEALTH: web.AppKey[MirrorHealth] = web.AppKey("specrag_mirror_health")
"""The application's reader of :func:`mirror_health` (absent: no mirror), merged into /health."""


class MirrorCollector(Collector):
    """``specrag_kv_mirror_exact{replica}``, the lag gauges and the mirrors' counters, read at each
    scrape."""

    def __init__(self, mirrors: Sequence[KVMirror]) -> None:
        self._mirrors = tuple(mirrors)

    def collect(self) -> Iterator[Metric]:
        exact = GaugeMetricFamily(
            "specrag_kv_mirror_exact",
            "1 while the replica's KV mirror is exact (its blocks are the engine's), 0 while degraded",
            labels=["replica"],
        )
        lag_batches = GaugeMetricFamily(
            "specrag_kv_mirror_lag_batches",
            "KV event batches sent (received, or being replayed) that the tree has not applied yet",
            labels=["replica"],
        )
        lag_seconds = GaugeMetricFamily(
            "specrag_kv_mirror_lag_seconds",
            "Seconds since the oldest KV event batch received and not yet applied arrived (0: none waits)",
            labels=["replica"],
        )
        counters = {
            name: CounterMetricFamily(f"specrag_kv_mirror_{name}", documentation, labels=["replica"])
            for name, documentation in (
                ("duplicate_copies", "BlockStored events of a block already cached (another physical copy)"),
                ("unknown_removals", "BlockRemoved events of a block the mirror never saw stored"),
                (
                    "sequence_resets",
                    "New event publishers seen (sequence numbers going back: a restarted engine)",
                ),
                ("lost_batches", "KV event batches neither received nor replayed, or unreadable"),
                ("failed_batches", "KV event batches that could not be applied"),
                (
                    "expired_predictions",
                    "Blocks predicted cached at a first token that no event confirmed in time",
                ),
                ("recoveries", "Prefix-cache resets of the engine asked for to make a degraded mirror exact"),
            )
        }
        for mirror in self._mirrors:
            status, faults, counts = mirror.status, mirror.faults(), mirror.tree.mirror_counts
            exact.add_metric([mirror.name], float(status.exact))
            lag = mirror.lag()
            lag_batches.add_metric([mirror.name], float(lag.batches))
            lag_seconds.add_metric([mirror.name], lag.seconds)
            for name, value in (
                ("duplicate_copies", counts.duplicate_copies),
                ("unknown_removals", counts.unknown_removals),
                ("sequence_resets", faults.sequence_resets),
                ("lost_batches", faults.lost_batches),
                ("failed_batches", faults.callback_errors),
                ("expired_predictions", counts.expired_predictions),
                ("recoveries", status.recoveries),
            ):
                counters[name].add_metric([mirror.name], value)
        yield exact
        yield lag_batches
        yield lag_seconds
        yield from counters.values()


def mirror_health(mirrors: Sequence[KVMirror]) -> dict[str, dict[str, object]]:
    """Per replica name: ``kv_mirror`` ("exact" or "degraded"), when degraded why, and its lag."""
    return {mirror.name: _health_of(mirror) for mirror in mirrors}


def _health_of(mirror: KVMirror) -> dict[str, object]:
    status, lag = mirror.status, mirror.lag()
    return {
        "kv_mirror": "exact" if status.exact else "degraded",
        "kv_mirror_reason": status.reason,
        "kv_mirror_lag_batches": lag.batches,
        "kv_mirror_lag_seconds": round(lag.seconds, 3),
    }
