"""Keep the knowledge tree in step with the engine's prefix cache through vLLM's KV-cache events.

With events the tree knows exactly which blocks the engine holds and which it evicted; without
them (an engine that publishes none) it keeps using its capacity model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specrag.cache.tree import KnowledgeTree
from specrag.pipeline.config import EngineConfig

if TYPE_CHECKING:
    from specrag.pipeline.kv_events import KVEventSubscriber


class KVMirror:
    """Subscribes the tree to the engine's KV events; a no-op when the engine publishes none."""

    def __init__(self, tree: KnowledgeTree, config: EngineConfig) -> None:
        self.tree = tree
        self.config = config
        self._subscriber: KVEventSubscriber | None = None

    @property
    def active(self) -> bool:
        return self._subscriber is not None

    async def start(self, catch_up: bool = True) -> None:
        """Subscribe; ``catch_up=False`` right after emptying the engine's cache (see the subscriber)."""
        if self.config.kv_events_endpoint is None or self._subscriber is not None:
            return
        # The subscriber decodes with vLLM's own classes: import it only when events are on.
        from specrag.pipeline.kv_events import KVEventSubscriber

        subscriber = KVEventSubscriber(
            self.config.kv_events_endpoint,
            self.config.kv_events_replay_endpoint,
            self.config.kv_events_topic,
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
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            await subscriber.stop()
