"""Keep the knowledge tree in step with the engine's prefix cache through vLLM's KV-cache events.

With events the tree knows exactly which blocks the engine holds and which it evicted; without
them (an engine that publishes none) it keeps using its capacity model. The events come from the
in-process engine's IPC sockets or, for a separate engine server, from its TCP publisher
(``serve --engine-kv-events``).

The mirror says whether it is *exact* (its resident block hashes are the engine's, as far as a
complete event stream tells) or *degraded*, with the reason (docs/ordering.md). It is exact once
the subscription has joined and replayed the engine's history (none, for a fresh engine); beside
an engine whose history its replay buffer no longer holds from the start it is degraded, but it
does not empty that engine's cache: nothing the mirror followed was lost, and a shared or warm
engine would lose its cache at every start. It degrades when a batch is lost or cannot be
applied, and comes back to exact when the stream shows the engine's cache emptied (an
``AllBlocksCleared`` event, or a new publisher: a restarted engine). After such a loss, a
background task asks the engine to reset its prefix cache, which vLLM does only when no request
holds blocks (an idle engine): the reset's ``AllBlocksCleared`` then makes it exact.
vLLM publishes events only at the end of an engine step, so on an idle engine that event comes with
the next request's first step; the tree is emptied at the reset already, so the prompts ordered
meanwhile are ordered against what the engine holds. The same task subscribes again, with a
replay, when the subscriber's receiving task has stopped on an error.
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
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.kv_mirror.target import MirrorLag, MirrorTarget

if TYPE_CHECKING:
    from specrag.pipeline.kv_mirror.subscriber import KVEventSubscriber

__all__ = ["WAITING_FOR_CLEAR", "WAITING_FOR_JOIN", "KVMirror", "MirrorFaults", "MirrorLag", "MirrorStatus"]

logger = logging.getLogger(__name__)

WAITING_FOR_JOIN = "the KV event subscription has not joined the engine's publisher yet"
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
    tried every ``recovery_interval_s`` while degraded by one; None leaves the mirror degraded
    until the stream itself shows an emptied cache. :meth:`start` waits up to ``join_wait_s`` for
    the subscription to join, so that a service started beside a running engine says exact from
    its first health check.
    """

    def __init__(
        self,
        tree: KnowledgeTree,
        source: KVEventSource,
        *,
        name: str = "r0",
        reset_engine: Callable[[], Awaitable[None]] | None = None,
        recovery_interval_s: float = 1.0,
        join_wait_s: float = 2.0,
    ) -> None:
        if recovery_interval_s <= 0:
            raise ValueError(f"recovery_interval_s must be positive, got {recovery_interval_s}")
        self.tree = tree
        self.source = source
        self.name = name
        self._reset_engine = reset_engine
        self._recovery_interval_s = recovery_interval_s
        self._join_wait_s = join_wait_s
        self._subscriber: KVEventSubscriber | None = None
        self._watch: asyncio.Task[None] | None = None
        self._subscribing = asyncio.Lock()  # one subscriber at a time, whoever replaces it
        self._earlier = MirrorFaults()  # of the subscribers replaced since (engine restarts)
        self._degraded: str | None = WAITING_FOR_JOIN
        self._lost = False  # degraded by a loss in the stream it followed: a reset may mend it
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
        return MirrorTarget(self._apply, self._publisher_started, self._degrade, self._unsure)

    def faults(self) -> MirrorFaults:
        """Event batches the tree never saw, failures to apply one, and new publishers, since the
        mirror was made (the service exports them in ``/metrics`` rather than only logging them)."""
        current = self._subscriber
        if current is None:
            return self._earlier
        sequence = current.sequence
        return MirrorFaults(
            self._earlier.applied_batches + current.applied_batches,
            self._earlier.lost_batches + sequence.lost + sequence.undecodable,
            self._earlier.callback_errors + current.callback_errors,
            self._earlier.sequence_resets + sequence.sequence_resets,
        )

    def lag(self) -> MirrorLag:
        """How far the tree is behind the events received (none without a subscriber)."""
        return MirrorLag() if self._subscriber is None else self._subscriber.lag()

    async def start(self, catch_up: bool = True) -> None:
        """Subscribe; ``catch_up=False`` right after emptying the engine's cache (see the subscriber).
        Either way the mirror is exact once the subscription has joined: before, a batch the
        engine publishes could pass it by unseen."""
        async with self._subscribing:
            if self._subscriber is not None:
                return
            subscriber = await self._subscribe(catch_up)
        self._watch_from_now()
        if self.source.replay_endpoint is not None:  # without one, only a batch proves the join
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._join_wait_s):
                    await subscriber.joined.wait()

    async def restart(self) -> None:
        """Resubscribe, replaying the engine's history: a restarted engine numbers its batches from
        zero (its cache is empty); an engine that was only out of reach keeps its cache, which the
        replay brings back without emptying it.

        The restart counts as a sequence reset: the new subscriber never sees the sequence go back
        (it starts at the new publisher's batch 0), so without this ``/metrics`` would not show it.
        """
        async with self._subscribing:
            await self._unsubscribe()
            self._earlier = replace(self._earlier, sequence_resets=self._earlier.sequence_resets + 1)
            await self._subscribe(catch_up=True)
        self._watch_from_now()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        async with self._subscribing:
            await self._unsubscribe()

    async def _subscribe(self, catch_up: bool) -> KVEventSubscriber:
        # The subscriber decodes with vLLM's own classes: import it only when events are on.
        from specrag.pipeline.kv_mirror.subscriber import KVEventSubscriber

        self._degraded, self._lost = WAITING_FOR_JOIN, False
        subscriber = KVEventSubscriber(
            self.source.endpoint,
            self.source.replay_endpoint,
            self.source.topic,
            self.target,
            catch_up=catch_up,
        )
        await subscriber.start()
        self._subscriber = subscriber
        return subscriber

    async def _unsubscribe(self) -> None:
        self._earlier = self.faults()
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            await subscriber.stop()

    def _watch_from_now(self) -> None:
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_forever(), name=f"kv-mirror-{self.name}")

    async def _watch_forever(self) -> None:
        """Subscribe again when the receiving task stopped on an error; else mend a loss."""
        while True:
            await asyncio.sleep(self._recovery_interval_s)
            subscriber = self._subscriber
            if subscriber is not None and subscriber.failure is not None:
                logger.warning("KV mirror %s subscribes again: its subscriber stopped", self.name)
                async with self._subscribing:
                    if self._subscriber is subscriber:  # not replaced meanwhile
                        await self._unsubscribe()
                        await self._subscribe(catch_up=True)
            else:
                await self.recover()

    async def recover(self) -> bool:
        """If degraded by a loss, reset the engine's prefix cache and the tree; True if the engine
        did. A mirror that is only unsure (waiting for its subscription to join, beside a history
        its replay no longer holds) leaves the engine's cache alone.

        The mirror becomes exact only when the reset's ``AllBlocksCleared`` arrives through the
        stream: batches published before the reset may still be on their way. It waits for that
        event from before it asks: vLLM publishes the event with the engine's next step, which a
        query running meanwhile can take before the reset's reply reaches this coroutine. Marked
        only after the reply, an event applied in between was followed by a wait for one that
        had already come, and the mirror stayed degraded for good.
        """
        if not self._lost or self._degraded == WAITING_FOR_CLEAR or self._reset_engine is None:
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

    def _apply(self, events: Sequence[KVEvent]) -> None:
        self.tree.apply_events(events)
        if self._degraded is not None and any(isinstance(event, AllBlocksCleared) for event in events):
            # Applied in order: after the clear the tree holds what the engine holds.
            logger.info("KV mirror %s is exact again (the engine cleared its cache)", self.name)
            self._degraded, self._lost = None, False

    def _publisher_started(self) -> None:
        """A publisher's batch 0 on: the engine's cache was empty then, and so is the tree."""
        self.tree.engine_cache_cleared()
        self._degraded, self._lost = None, False

    def _degrade(self, reason: str) -> None:
        """A batch of the stream followed was lost or not applied: a reset of the engine mends it."""
        if self._degraded is None:
            logger.warning("KV mirror %s is degraded: %s", self.name, reason)
        self._degraded, self._lost = reason, True

    def _unsure(self, reason: str) -> None:
        """The engine's cache cannot be known, yet nothing followed was lost: no reset for it."""
        logger.warning("KV mirror %s is degraded: %s", self.name, reason)
        self._degraded, self._lost = reason, False
