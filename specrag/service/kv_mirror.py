"""Keep the knowledge tree in step with the engine's prefix cache through vLLM's KV-cache events.

With events the tree knows exactly which blocks the engine holds and which it evicted; without
them (an engine that publishes none) it keeps using its capacity model. The events come from the
in-process engine's IPC sockets or, for a separate engine server, from its TCP publisher
(``serve --engine-kv-events``).

The mirror says whether it is *exact* (its resident block hashes are the engine's, as far as a
complete event stream tells) or *degraded*, with the reason (docs/ordering.md). It degrades when
a batch is lost or cannot be applied, and comes back to exact when the stream shows the engine's
cache emptied (an ``AllBlocksCleared`` event, or a new publisher: a restarted engine). While
degraded, a background task asks the engine to reset its prefix cache, which vLLM does only when
no request holds blocks (an idle engine): the reset's ``AllBlocksCleared`` then makes it exact.
vLLM publishes events only at the end of an engine step, so on an idle engine that event comes with
the next request's first step; the tree is emptied at the reset already, so the prompts ordered
meanwhile are ordered against what the engine holds.
Ordering and routing keep working while degraded, on a tree that may be wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specrag.cache.events import AllBlocksCleared, KVEvent
from specrag.cache.tree import KnowledgeTree
from specrag.errors import EngineError
from specrag.pipeline.config import KVEventSource

if TYPE_CHECKING:
    from specrag.pipeline.kv_events import KVEventSubscriber, MirrorTarget

__all__ = ["WAITING_FOR_CLEAR", "WAITING_FOR_FIRST_BATCH", "KVMirror", "MirrorFaults", "MirrorStatus"]

logger = logging.getLogger(__name__)

WAITING_FOR_FIRST_BATCH = "no KV event batch received yet"
WAITING_FOR_CLEAR = "the engine's prefix cache was reset; waiting for its AllBlocksCleared event"


@dataclass(frozen=True)
class MirrorFaults:
    """What the mirror applied and what it missed since it was made: event batches applied, lost
    (or unreadable), failed to apply, and new publishers seen (sequence numbers going back)."""

    applied_batches: int = 0
    lost_batches: int = 0
    callback_errors: int = 0
    sequence_resets: int = 0


@dataclass(frozen=True)
class MirrorStatus:
    """Whether the mirror is exact and, when it is not, why; ``recoveries``: engine prefix-cache
    resets it asked for to become exact again."""

    exact: bool
    reason: str | None
    recoveries: int


class KVMirror:
    """Subscribes the tree to the KV events an engine publishes at ``source``, and keeps its state.

    ``reset_engine`` (the engine's ``reset_prefix_cache``) is the way back to exact after a loss:
    tried every ``recovery_interval_s`` while degraded; None leaves the mirror degraded until the
    stream itself shows an emptied cache.
    """

    def __init__(
        self,
        tree: KnowledgeTree,
        source: KVEventSource,
        *,
        name: str = "r0",
        reset_engine: Callable[[], Awaitable[None]] | None = None,
        recovery_interval_s: float = 1.0,
    ) -> None:
        if recovery_interval_s <= 0:
            raise ValueError(f"recovery_interval_s must be positive, got {recovery_interval_s}")
        self.tree = tree
        self.source = source
        self.name = name
        self._reset_engine = reset_engine
        self._recovery_interval_s = recovery_interval_s
        self._subscriber: KVEventSubscriber | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._earlier = MirrorFaults()  # of the subscribers replaced since (engine restarts)
        self._degraded: str | None = WAITING_FOR_FIRST_BATCH
        self._recoveries = 0

    @property
    def active(self) -> bool:
        return self._subscriber is not None

    @property
    def status(self) -> MirrorStatus:
        return MirrorStatus(self._degraded is None, self._degraded, self._recoveries)

    @property
    def target(self) -> MirrorTarget:
        """What an event stream feeds (the subscriber, or a test driving one by hand)."""
        from specrag.pipeline.kv_events import MirrorTarget

        return MirrorTarget(self._apply, self._publisher_started, self._degrade)

    def faults(self) -> MirrorFaults:
        """Event batches the tree never saw, failures to apply one, and new publishers, since the
        mirror was made (the service exports them in ``/metrics`` rather than only logging them)."""
        current = self._subscriber
        if current is None:
            return self._earlier
        sequence = current.sequence
        return MirrorFaults(
            self._earlier.applied_batches + sequence.batches - sequence.callback_errors,
            self._earlier.lost_batches + sequence.lost + sequence.undecodable,
            self._earlier.callback_errors + sequence.callback_errors,
            self._earlier.sequence_resets + sequence.sequence_resets,
        )

    async def start(self, catch_up: bool = True) -> None:
        """Subscribe; ``catch_up=False`` right after emptying the engine's cache (see the subscriber):
        the mirror is then exact from the start, else from the engine's first batch on."""
        if self._subscriber is not None:
            return
        # The subscriber decodes with vLLM's own classes: import it only when events are on.
        from specrag.pipeline.kv_events import KVEventSubscriber

        if not catch_up:
            self._degraded = None
        subscriber = KVEventSubscriber(
            self.source.endpoint,
            self.source.replay_endpoint,
            self.source.topic,
            self.target,
            catch_up=catch_up,
        )
        await subscriber.start()
        self._subscriber = subscriber
        if self._reset_engine is not None and self._recovery is None:
            self._recovery = asyncio.create_task(self._recover_forever(), name=f"kv-mirror-{self.name}")

    async def restart(self) -> None:
        """Resubscribe from the engine's first batch: a restarted engine numbers them from zero.

        The restart counts as a sequence reset: the new subscriber never sees the sequence go back
        (it starts at the new publisher's batch 0), so without this ``/metrics`` would not show it.
        """
        await self.stop()
        self._earlier = replace(self._earlier, sequence_resets=self._earlier.sequence_resets + 1)
        self._degraded = WAITING_FOR_FIRST_BATCH
        await self.start()

    async def stop(self) -> None:
        self._earlier = self.faults()
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
            self._recovery = None
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            await subscriber.stop()

    async def recover(self) -> bool:
        """If degraded, reset the engine's prefix cache and the tree; True if the engine did.

        The mirror becomes exact only when the reset's ``AllBlocksCleared`` arrives through the
        stream: batches published before the reset may still be on their way. It waits for that
        event from before it asks: vLLM publishes the event with the engine's next step, which a
        query running meanwhile can take before the reset's reply reaches this coroutine. Marked
        only after the reply, an event applied in between was followed by a wait for one that
        had already come, and the mirror stayed degraded for good.
        """
        if self._degraded in (None, WAITING_FOR_CLEAR) or self._reset_engine is None:
            return False
        reason, self._degraded = self._degraded, WAITING_FOR_CLEAR
        try:
            await self._reset_engine()
        except EngineError as error:  # requests held blocks the whole time: try again later
            logger.info("KV mirror %s: the engine did not reset its prefix cache yet: %s", self.name, error)
            if self._degraded == WAITING_FOR_CLEAR:  # unless something else degraded it meanwhile
                self._degraded = reason
            return False
        self._recoveries += 1
        if self._degraded == WAITING_FOR_CLEAR:  # the clear is still due: forget the engine's blocks now
            self.tree.engine_cache_cleared()
        logger.info("KV mirror %s: reset the engine's prefix cache to become exact again", self.name)
        return True

    async def _recover_forever(self) -> None:
        while True:
            await asyncio.sleep(self._recovery_interval_s)
            await self.recover()

    def _apply(self, events: Sequence[KVEvent]) -> None:
        self.tree.apply_events(events)
        if self._degraded is not None and any(isinstance(event, AllBlocksCleared) for event in events):
            # Applied in order: after the clear the tree holds what the engine holds.
            logger.info("KV mirror %s is exact again (the engine cleared its cache)", self.name)
            self._degraded = None

    def _publisher_started(self) -> None:
        """A publisher's batch 0 on: the engine's cache was empty then, and so is the tree."""
        self.tree.engine_cache_cleared()
        self._degraded = None

    def _degrade(self, reason: str) -> None:
        if self._degraded is None:
            logger.warning("KV mirror %s is degraded: %s", self.name, reason)
        self._degraded = reason
