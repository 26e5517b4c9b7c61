"""How each replica's KV mirror stands, for ``/metrics`` and ``/health``.

A mirror that drifted from the engine's cache mispredicts cached tokens and misorders documents
without failing anything, so its state is exported rather than only logged: per replica whether
it is exact (1) or degraded (0) and the counters of what the event stream did (docs/ordering.md).
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
    """``specrag_kv_mirror_exact{replica}`` and the mirrors' counters, read at each scrape."""

    def __init__(self, mirrors: Sequence[KVMirror]) -> None:
        self._mirrors = tuple(mirrors)

    def collect(self) -> Iterator[Metric]:
        exact = GaugeMetricFamily(
            "specrag_kv_mirror_exact",
            "1 while the replica's KV mirror is exact (its blocks are the engine's), 0 while degraded",
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
        yield from counters.values()


def mirror_health(mirrors: Sequence[KVMirror]) -> dict[str, dict[str, object]]:
    """Per replica name: ``kv_mirror`` ("exact" or "degraded") and, when degraded, why."""
    return {
        mirror.name: {
            "kv_mirror": "exact" if mirror.status.exact else "degraded",
            "kv_mirror_reason": mirror.status.reason,
        }
        for mirror in mirrors
    }
