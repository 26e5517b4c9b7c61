"""Keep the knowledge tree in step with the engine's prefix cache through vLLM's KV-cache events.

With events the tree knows exactly which blocks the engine holds and which it evicted; without
them (an engine that publishes none) it keeps using its capacity model. The events come from the
in-process engine's IPC sockets or, for a separate engine server, from its TCP publisher
(``serve --engine-kv-events``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specrag.cache.tree import KnowledgeTree
from specrag.pipeline.config import KVEventSource

if TYPE_CHECKING:
    from specrag.pipeline.kv_events import KVEventSubscriber

__all__ = ["KVMirror", "MirrorFaults"]


@dataclass(frozen=True)
class MirrorFaults:
    """What the mirror applied and what it missed: event batches lost (or unreadable) and
    callback errors."""

    applied_batches: int = 0
    lost_batches: int = 0
    callback_errors: int = 0


class KVMirror:
    """Subscribes the tree to the KV events an engine publishes at ``source``."""

    def __init__(self, tree: KnowledgeTree, source: KVEventSource) -> None:
        self.tree = tree
        self.source = source
        self._subscriber: KVEventSubscriber | None = None
        self._earlier = MirrorFaults()  # of the subscribers replaced since (engine restarts)

    @property
    def active(self) -> bool:
        return self._subscriber is not None

    def faults(self) -> MirrorFaults:
        """Event batches the tree never saw, and callback failures, since the mirror was made.

        Either means the tree may believe blocks cached that are not (or the reverse): the
        service exports both in ``/metrics`` rather than only logging them.
        """
        current = self._subscriber
        if current is None:
            return self._earlier
        return MirrorFaults(
            self._earlier.applied_batches + current.batches - current.callback_errors,
            self._earlier.lost_batches + current.lost + current.undecodable,
            self._earlier.callback_errors + current.callback_errors,
        )

    async def start(self, catch_up: bool = True) -> None:
        """Subscribe; ``catch_up=False`` right after emptying the engine's cache (see the subscriber)."""
        if self._subscriber is not None:
            return
        # The subscriber decodes with vLLM's own classes: import it only when events are on.
        from specrag.pipeline.kv_events import KVEventSubscriber

        subscriber = KVEventSubscriber(
            self.source.endpoint,
            self.source.replay_endpoint,
            self.source.topic,
            self.tree.apply_events,
            catch_up=catch_up,
        )
        await subscriber.start()
        self._subscriber = subscriber

    async def restart(self) -> None:
        """Resubscribe from the engine's first batch: a restarted engine numbers them from zero."""
        await self.stop()
        await self.start()

    async def stop(self) -> None:
        self._earlier = self.faults()
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            await subscriber.stop()
